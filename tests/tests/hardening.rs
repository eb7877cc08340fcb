//! The hardening a security review asked for (issue 14), each checked over HTTP against a real
//! server: bounded streams and long-polls, webhook targets, outage grace for liveness, keyed
//! request hashes, registered images for provider pools, validated host reports, metric
//! labels, and a server that refuses to start without a sealing key.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use vps_tests::{acme_instance, eventually, TestServer, ALICE, OPERATOR, PATIENCE, SSH_KEY};

/// A hosted pool offered to acme (8 vCPU), with `nodes` nodes and the harness's flavors and
/// image.
async fn small_pool(t: &TestServer, nodes: usize) -> String {
    t.hosted_pool(
        "10.0.0.0/24",
        nodes,
        json!({ "vcpu": 8, "memoryGiB": 16, "diskGiB": 100 }),
    )
    .await
}

/// The value of an unlabelled gauge, 0 when it is not rendered yet.
fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// Opens an event stream as `token` whose filter matches nothing; the open response (or the
/// error status).
async fn open_stream(t: &TestServer, token: &str) -> Result<reqwest::Response, u16> {
    let response = t
        .http
        .get(format!(
            "{}/api/compute/events/stream?types=nothing.matches.*",
            t.server.url()
        ))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    match response.status().as_u16() {
        200 => Ok(response),
        status => Err(status),
    }
}

#[tokio::test]
async fn event_streams_are_capped_per_tenant_and_a_gone_client_frees_its_place() {
    let t = TestServer::start_with(|c| c.limits.sse_streams_per_tenant = 2).await;
    let first = open_stream(&t, ALICE).await.expect("first stream");
    let second = open_stream(&t, ALICE).await.expect("second stream");
    assert_eq!(open_stream(&t, ALICE).await.unwrap_err(), 429);
    assert!(gauge(&t.metrics().await, "vps_sse_streams") >= 2.0);
    // Another tenant has places of its own.
    let other = open_stream(&t, vps_tests::EVE)
        .await
        .expect("globex's stream");
    drop(other);

    // The clients go away; their filters never matched, yet their tasks end.
    drop(first);
    drop(second);
    eventually("the streams' places freed", PATIENCE, || async {
        let open = gauge(&t.metrics().await, "vps_sse_streams");
        if open == 0.0 {
            Ok(())
        } else {
            Err(open)
        }
    })
    .await;
    let again = open_stream(&t, ALICE).await.expect("a place again");
    drop(again);
}

#[tokio::test]
async fn spec_long_polls_are_capped_per_node() {
    let t = TestServer::start_with(|c| c.limits.long_polls_per_node = 1).await;
    let pool = small_pool(&t, 0).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    // One long-poll holds the node's place (it asks again if a probe held it first).
    let waiting = {
        let (url, http, node, token) =
            (t.server.url(), t.http.clone(), node.clone(), token.clone());
        tokio::spawn(async move {
            loop {
                let status = http
                    .post(format!("{url}/api/compute/nodes/spec"))
                    .bearer_auth(&token)
                    .json(&json!({ "nodeId": node, "afterGeneration": 1_000_000, "waitMs": 4000 }))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                if status != 429 {
                    return status;
                }
            }
        })
    };
    let probe = json!({ "nodeId": node, "afterGeneration": 1_000_000, "waitMs": 50 });
    eventually("a second long-poll refused", PATIENCE, || async {
        match t.call(&token, "nodes.spec", probe.clone()).await {
            Err(a) if a.status == 429 && a.body["code"] == "RATE_LIMITED" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // A read that does not wait holds no place.
    t.ok(&token, "nodes.spec", json!({ "nodeId": node })).await;
    assert_eq!(waiting.await.unwrap(), 200);
    t.ok(
        &token,
        "nodes.spec",
        json!({ "nodeId": node, "waitMs": 10 }),
    )
    .await;
}

#[tokio::test]
async fn a_read_that_finds_nothing_moves_past_what_it_scanned() {
    let t = TestServer::start().await;
    small_pool(&t, 1).await;
    t.settle().await;
    let filter = vps_events::read::Filter {
        types: vec!["nothing.matches.*".into()],
        tenant_id: Some("acme".into()),
        ..Default::default()
    };
    let pool = &t.server.state.pool;
    let page = vps_events::read::read_page(pool, vps_events::Cursor::START, &filter, 10)
        .await
        .unwrap();
    assert!(page.events.is_empty());
    let last = vps_events::read::read_after(pool, vps_events::Cursor::START, 10_000)
        .await
        .unwrap()
        .last()
        .unwrap()
        .cursor();
    assert!(
        page.next > last,
        "the next read starts after every event read: {page:?}"
    );

    // The tenant filter is served by an index in read order, not by a scan of the log.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT position FROM events
          WHERE (transaction_id, position) > ('0'::xid8, 0) AND metadata->>'tenantId' = 'acme'
          ORDER BY transaction_id, position LIMIT 10",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert!(plan.join("\n").contains("events_by_tenant"), "{plan:#?}");
}

/// Creates a webhook as `token`; the answer or the error answer.
async fn create_webhook(
    t: &TestServer,
    token: &str,
    url: &str,
) -> Result<Value, vps_tests::Answer> {
    t.call(
        token,
        "webhooks.create",
        json!({ "url": url, "types": ["instance.*"] }),
    )
    .await
}

#[tokio::test]
async fn webhooks_cannot_target_the_control_planes_own_networks() {
    // The harness allows 127.0.0.0/8 (the test receivers' network), and nothing else.
    let t = TestServer::start().await;
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1:5432/",
        "http://192.168.1.1/",
        "http://172.16.0.10/",
        "http://[::1]:8080/",
        "http://[fe80::1]/",
        "http://[fd00::1]/",
        "http://[::ffff:10.0.0.1]/",
    ] {
        let refused = create_webhook(&t, ALICE, url).await.unwrap_err();
        assert_eq!(refused.status, 400, "{url}: {}", refused.body);
        assert_eq!(refused.body["code"], "INVALID_INPUT", "{url}");
    }
    create_webhook(&t, ALICE, "http://127.0.0.1:9/hook")
        .await
        .unwrap();
    create_webhook(&t, ALICE, "https://93.184.215.14/hook")
        .await
        .unwrap();

    let strict = TestServer::start_with(|c| c.webhooks.allow_private.clear()).await;
    let refused = create_webhook(&strict, ALICE, "http://127.0.0.1:9/hook")
        .await
        .unwrap_err();
    assert_eq!(refused.body["code"], "INVALID_INPUT");
    let refused = create_webhook(&strict, ALICE, "http://localhost:9/hook")
        .await
        .unwrap_err();
    assert_eq!(refused.body["code"], "INVALID_INPUT");
}

#[tokio::test]
async fn a_tenant_has_at_most_50_webhooks_and_their_secrets_are_sealed() {
    let t = TestServer::start().await;
    let mut secrets = Vec::new();
    for n in 0..50 {
        let hook = create_webhook(&t, ALICE, &format!("https://93.184.215.14/hook/{n}"))
            .await
            .unwrap();
        secrets.push(hook["secret"].as_str().unwrap().to_string());
    }
    let refused = create_webhook(&t, ALICE, "https://93.184.215.14/one-more")
        .await
        .unwrap_err();
    assert_eq!(refused.status, 409, "{}", refused.body);
    // Another tenant is not held back by acme's.
    create_webhook(&t, vps_tests::EVE, "https://93.184.215.14/globex")
        .await
        .unwrap();

    let pool = &t.server.state.pool;
    let plain: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_secrets")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(plain, 0, "no secret is stored in the clear");
    let sealed: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT ciphertext FROM sealed_secrets WHERE ref LIKE 'secret://whk_%/signing'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(sealed.len(), 51);
    for ciphertext in sealed {
        let text = String::from_utf8_lossy(&ciphertext);
        assert!(secrets.iter().all(|s| !text.contains(&s[6..])));
    }
}

#[tokio::test]
async fn nodes_get_a_fresh_grace_period_after_the_control_planes_outage() {
    let lost_after = 2u32;
    let t = TestServer::start_with(|c| c.timings.liveness_check = 0.1).await;
    let pool = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "fragile", "class": "vps-host",
                    "policy": { "recreateOnHostLoss": false, "lostAfterSeconds": lost_after } }),
        )
        .await;
    let (node, token) = t
        .register_node(pool["id"].as_str().unwrap(), "host-a")
        .await;
    let report = json!({ "nodeId": node, "instances": [], "complete": false });
    t.ok(&token, "nodes.report", report.clone()).await;

    // The control plane goes down for longer than lostAfterSeconds.
    let TestServer {
        server,
        http,
        snapshots,
        clock,
    } = t;
    let (db, config) = (server.state.pool.clone(), (*server.state.config).clone());
    server.shutdown().await;
    // An outage longer than lostAfterSeconds, on the server's clock.
    clock.advance(Duration::from_secs(u64::from(lost_after) + 2));
    let outage: bool = sqlx::query_scalar(
        "SELECT $2 - last_report_at > make_interval(secs => $1 + 1) FROM node_heartbeats",
    )
    .bind(f64::from(lost_after))
    .bind(clock.now())
    .fetch_one(&db)
    .await
    .unwrap();
    assert!(outage, "an outage longer than lostAfterSeconds");
    let t = TestServer {
        server: vps_api::server::start_with_clock(config, db, clock.clock())
            .await
            .expect("restarts"),
        http,
        snapshots,
        clock,
    };

    // The host reports again within lostAfterSeconds of the restart, and keeps reporting.
    let started = Instant::now();
    let mut reported = false;
    while started.elapsed() < Duration::from_secs(u64::from(lost_after) * 2) {
        let seen = t.ok(OPERATOR, "nodes.get", json!({ "nodeId": node })).await;
        assert_ne!(
            seen["state"], "lost",
            "marked lost before it could report: {seen}"
        );
        if started.elapsed() > Duration::from_secs(1) {
            t.ok(&token, "nodes.report", report.clone()).await;
            reported = true;
        }
        // Observing over time: each look is a poll of the node's state.
        tokio::time::sleep(vps_tests::POLL).await;
    }
    assert!(reported);
}

/// A hosted create of acme's with `user_data` and idempotency key `key`.
fn create_body(pool: &str, key: &str, user_data: &str) -> Value {
    json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
            "sshKeys": [SSH_KEY], "userData": user_data, "idempotencyKey": key })
}

#[tokio::test]
async fn instance_created_carries_no_plain_hash_of_the_user_data() {
    let t = TestServer::start().await;
    let pool = small_pool(&t, 1).await;
    let body = create_body(&pool, "k1", "#cloud-config\npassword: hunter2\n");
    let created = t.ok(ALICE, "instances.create", body.clone()).await;
    let history = t
        .ok(ALICE, "instances.history", acme_instance(&created["id"]))
        .await;
    let hash = history["items"][0]["data"]["requestHash"]
        .as_str()
        .unwrap()
        .to_string();
    // What an unkeyed hash of the request would be: anyone reading the log could test
    // guesses of the user data against it.
    let input: vps_commands::instances::CreateInput = serde_json::from_value(body.clone()).unwrap();
    let plain =
        data_encoding::HEXLOWER.encode(&Sha256::digest(serde_json::to_vec(&input).unwrap()));
    assert_ne!(hash, plain);
    assert!(!history.to_string().contains("hunter2"));

    // Replays and conflicts still work.
    let replay = t.ok(ALICE, "instances.create", body).await;
    assert_eq!(replay["id"], created["id"]);
    let other = create_body(&pool, "k1", "#cloud-config\npassword: other\n");
    let conflict = t.err(ALICE, "instances.create", other).await;
    assert_eq!(conflict.body["code"], "CONFLICT");
}

/// A provider pool on a new account (`providerAccounts.create`'s body), offered to acme, with
/// a flavor `small` of `offer_id`; answers the pool's id.
async fn provider_pool(t: &TestServer, account: Value, offer_id: &str) -> String {
    let account = t.ok(OPERATOR, "providerAccounts.create", account).await;
    let pool = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "cloud", "class": "provider", "providerAccountId": account["id"] }),
        )
        .await;
    let pool_id = pool["id"].as_str().unwrap().to_string();
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": pool_id, "tenantId": "acme",
                "quota": { "vcpu": 10, "memoryGiB": 100, "diskGiB": 1000 } }),
    )
    .await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool_id, "name": "small", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20,
                "offerId": offer_id }),
    )
    .await;
    pool_id
}

#[tokio::test]
async fn a_provider_pool_boots_only_images_registered_for_the_tenant() {
    let t = TestServer::start().await;
    let pool_id = &provider_pool(
        &t,
        json!({ "provider": "emulator", "name": "cloud",
        "config": {} }),
        "emu-small",
    )
    .await;
    t.ok(
        OPERATOR,
        "images.register",
        json!({ "imageId": "snap-globex-db", "tenantId": "globex",
        "url": "https://images.example/db.img", "sha256": "c".repeat(64), "format": "raw" }),
    )
    .await;
    let create = |image: &str, key: &str| {
        json!({ "tenantId": "acme", "poolId": pool_id, "flavor": "small", "imageId": image,
                "idempotencyKey": key })
    };
    for (image, key) in [("snap-globex-db", "a"), ("1234567", "b")] {
        let refused = t.err(ALICE, "instances.create", create(image, key)).await;
        assert_eq!(refused.status, 404, "{image}: {}", refused.body);
    }
    t.ok(
        OPERATOR,
        "images.register",
        json!({ "imageId": "debian-12",
        "url": "https://images.example/debian.img", "sha256": "d".repeat(64), "format": "raw" }),
    )
    .await;
    t.ok(ALICE, "instances.create", create("debian-12", "c"))
        .await;
}

#[tokio::test]
async fn host_reported_addresses_are_validated_and_bounded() {
    let t = TestServer::start().await;
    let pool = small_pool(&t, 0).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let created = t
        .ok(ALICE, "instances.create", create_body(&pool, "k1", "x"))
        .await;
    let id = created["id"].as_str().unwrap();
    let report = |addresses: Value| {
        json!({ "nodeId": node, "complete": false,
                "instances": [{ "id": id, "state": "RUNNING", "addresses": addresses }] })
    };
    let too_many: Vec<String> = (1..=17).map(|n| format!("192.0.2.{n}")).collect();
    for bad in [
        json!(too_many),
        json!(["not-an-address"]),
        json!(["10.0.0.9/99"]),
    ] {
        let refused = t.err(&token, "nodes.report", report(bad.clone())).await;
        assert_eq!(refused.body["code"], "INVALID_INPUT", "{bad}");
    }
    // Many good reports, each with new addresses: the list stays bounded.
    for round in 0..3 {
        let fresh: Vec<String> = (1..=16)
            .map(|n| format!("198.51.100.{}", round * 16 + n))
            .collect();
        t.ok(&token, "nodes.report", report(json!(fresh))).await;
    }
    let seen = t.ok(ALICE, "instances.get", acme_instance(id)).await;
    let addresses = seen["addresses"].as_array().unwrap();
    assert_eq!(addresses.len(), 16, "{seen}");
    assert_eq!(
        addresses[0], created["addresses"][0],
        "the lease stays first"
    );
}

#[tokio::test]
async fn metric_labels_come_only_from_registered_method_names() {
    let t = TestServer::start().await;
    for path in [
        "zzprobe/anything",
        "instances/zzprobe",
        "zzprobe%2F..%2Fx/y",
    ] {
        let status = t
            .http
            .post(format!("{}/api/compute/{path}", t.server.url()))
            .bearer_auth(ALICE)
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .status();
        assert!(status.is_client_error(), "{path}: {status}");
    }
    t.ok(ALICE, "webhooks.list", json!({})).await;
    let text = t.metrics().await;
    assert!(text.contains("method=\"webhooks.list\""), "{text}");
    assert!(!text.contains("zzprobe"), "{text}");
}

#[tokio::test]
async fn the_server_refuses_to_start_without_a_sealing_key() {
    let pool = vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 4).await;
    let mut config = vps_api::config::Config::default();
    config.http.listen = "127.0.0.1:0".into();
    let refused = vps_api::server::start(config, pool)
        .await
        .err()
        .expect("refused");
    assert!(refused.to_string().contains("[secrets] key"), "{refused}");
}

#[tokio::test]
async fn a_providers_retry_after_is_honoured_for_at_most_an_hour() {
    let (base_url, cloud) = vps_emulators::hetzner::Emulator::start().await;
    let t = TestServer::start_with(|c| c.timings.provider_retry = 0.2).await;
    let account = json!({ "provider": "hetzner-cloud", "name": "cloud",
        "config": { "baseUrl": base_url, "token": cloud.token() } });
    let pool_id = &provider_pool(&t, account, "cx22").await;
    t.ok(
        OPERATOR,
        "images.register",
        json!({ "imageId": "ubuntu-24.04",
        "url": "https://images.example/u.img", "sha256": "e".repeat(64), "format": "raw" }),
    )
    .await;
    // The provider asks for thirty days.
    cloud.fail_next(1, vps_emulators::Fault::RateLimitedFor(30 * 86_400));
    let created = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool_id,
            "flavor": "small", "imageId": "ubuntu-24.04", "idempotencyKey": "k" }),
        )
        .await;
    let wait: f64 = eventually("the throttled call's retry time", PATIENCE, || async {
        sqlx::query_scalar::<_, Option<f64>>(
            "SELECT extract(epoch FROM retry_at - now())::float8 FROM work_items WHERE key = $1",
        )
        .bind(created["id"].as_str().unwrap())
        .fetch_optional(&t.server.state.pool)
        .await
        .unwrap()
        .flatten()
        .ok_or("not yet")
    })
    .await;
    assert!(wait <= 3600.0, "the instance waits {wait} s");
    assert!(
        wait > 3000.0,
        "the provider's wait is honoured up to the cap: {wait} s"
    );
}
