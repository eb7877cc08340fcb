//! Sandboxes over HTTP against a real server, its reconcilers and emulated hosts: templates,
//! warm claims and cold creates, lifetimes, extends, warm-pool upkeep, guards and events.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{
    acme_instance, acme_sandbox, eventually, merged, quota, TestServer, ALICE, BOB, EVE, OPERATOR,
    PATIENCE,
};

const BOOT: Duration = Duration::from_millis(50);

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.sandbox_expiring_lead = 2.0;
        c.timings.sandbox_expiring_min_lead = 0.5;
    })
    .await
}

/// A pool with `nodes` emulated hosts (kept running by the returned handles).
async fn pool_with_hosts(
    t: &TestServer,
    nodes: usize,
) -> (String, Vec<vps_emulators::host::HostHandle>) {
    t.pool_with_hosts("10.0.0.0/22", quota(1000), nodes, BOOT)
        .await
}

async fn create(t: &TestServer, token: &str, template: &str, key: &str, ttl: u64) -> Value {
    t.ok(
        token,
        "sandboxes.create",
        json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": key,
                "ttlSeconds": ttl, "wait": { "timeoutMs": 20000 } }),
    )
    .await
}

async fn sandbox(t: &TestServer, id: &str) -> Value {
    t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await
}

async fn instance(t: &TestServer, id: &str) -> Value {
    t.ok(OPERATOR, "instances.get", acme_instance(id)).await
}

/// The template's settled warm instances (paused), from the database.
async fn settled_warm(t: &TestServer, template: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM instances WHERE warm_template_id = $1 AND state = 'paused'
            AND desired_state <> 'deleted'",
    )
    .bind(template)
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap()
}

async fn wait_warm(t: &TestServer, template: &str, n: i64) {
    eventually(&format!("{n} settled warm instances"), PATIENCE, || async {
        let got = settled_warm(t, template).await;
        if got == n {
            Ok(())
        } else {
            Err(got)
        }
    })
    .await;
}

fn code(answer: Result<Value, vps_tests::Answer>) -> String {
    let err = answer.expect_err("a refusal");
    err.body["code"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn templates_are_checked_like_a_hosted_create() {
    let t = server().await;
    let pool = t.hosted_pool("10.0.0.0/24", 0, json!({ "vcpu": 10 })).await;
    let bare = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "bare", "class": "vps-host" }),
        )
        .await;
    let bare = bare["id"].as_str().unwrap();
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": bare, "tenantId": "acme", "quota": { "vcpu": 10 } }),
    )
    .await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": bare, "name": "small", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 }),
    )
    .await;
    let base = json!({ "tenantId": "acme", "name": "py", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu" });
    let with = |extra: Value| merged(base.clone(), extra);
    let cases = [
        (
            with(json!({ "poolId": "pool_01jzzzzzzzzzzzzzzzzzzzzzzz" })),
            "NOT_FOUND",
        ),
        (with(json!({ "flavor": "huge" })), "NOT_FOUND"),
        (with(json!({ "imageId": "img_nope" })), "NOT_FOUND"),
        (
            with(json!({ "env": { "KEY": "plain value" } })),
            "INVALID_INPUT",
        ),
        (
            with(json!({ "env": { "KEY": "secret://globex/key" } })),
            "INVALID_INPUT",
        ),
        (
            with(json!({ "env": { "1BAD": "secret://acme/key" } })),
            "INVALID_INPUT",
        ),
        (
            with(json!({ "defaultTtlSeconds": 7200, "maxTtlSeconds": 3600 })),
            "INVALID_INPUT",
        ),
        (
            with(json!({ "warm": { "min": 3, "max": 2 } })),
            "INVALID_INPUT",
        ),
        (
            with(json!({ "network": "private", "poolId": bare })),
            "INVALID_STATE",
        ),
        (with(json!({ "network": "open" })), "INVALID_INPUT"),
        (with(json!({ "colour": "blue" })), "INVALID_INPUT"),
    ];
    for (body, expected) in cases {
        let got = code(t.call(ALICE, "sandboxTemplates.create", body.clone()).await);
        assert_eq!(got, expected, "{body}");
    }
    // A secret the tenant wrote itself is accepted, and its value never shows.
    let secret = t
        .ok(
            ALICE,
            "secrets.put",
            json!({ "tenantId": "acme", "name": "key", "value": "s3cr3t" }),
        )
        .await;
    assert_eq!(secret["ref"], "secret://acme/key");
    let made = t
        .ok(
            ALICE,
            "sandboxTemplates.create",
            with(json!({ "env": { "KEY": "secret://acme/key" }, "network": "none" })),
        )
        .await;
    assert_eq!(
        (made["version"].as_u64(), made["network"].as_str()),
        (Some(1), Some("none"))
    );
    assert_eq!(
        (
            made["defaultTtlSeconds"].as_u64(),
            made["maxTtlSeconds"].as_u64()
        ),
        (Some(3600), Some(86400))
    );
    assert!(!made.to_string().contains("s3cr3t"));
    let id = made["id"].as_str().unwrap();
    assert_eq!(
        code(t.call(ALICE, "sandboxTemplates.create", base.clone()).await),
        "INVALID_INPUT",
        "the name is taken"
    );
    assert_eq!(
        code(
            t.call(
                EVE,
                "sandboxTemplates.get",
                json!({ "tenantId": "globex", "templateId": id })
            )
            .await
        ),
        "NOT_FOUND"
    );
    let updated = t
        .ok(
            ALICE,
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": id, "maxTtlSeconds": 7200 }),
        )
        .await;
    assert_eq!(updated["version"], 2);
    t.ok(
        ALICE,
        "sandboxTemplates.delete",
        json!({ "tenantId": "acme", "templateId": id }),
    )
    .await;
    assert_eq!(
        code(
            t.call(
                ALICE,
                "sandboxTemplates.get",
                json!({ "tenantId": "acme", "templateId": id })
            )
            .await
        ),
        "NOT_FOUND"
    );
    t.ok(ALICE, "sandboxTemplates.create", base).await; // the name is free again
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_warm_claim_moves_a_paused_instance_and_a_cold_create_admits_one() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 2).await;
    let tpl = t
        .sandbox_template(&pool, "py", json!({ "warm": { "min": 1, "max": 1 } }))
        .await;
    let tpl = tpl["id"].as_str().unwrap();
    wait_warm(&t, tpl, 1).await;
    let warm_instance = of_the_warm_instance(&t, tpl, "id").await;
    let listed = t
        .ok(ALICE, "instances.list", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(
        listed["items"].as_array().unwrap().len(),
        0,
        "warm instances are not listed"
    );
    assert_eq!(instance(&t, &warm_instance).await["warmTemplateId"], tpl);
    assert_eq!(
        code(
            t.call(ALICE, "instances.start", acme_instance(&warm_instance))
                .await
        ),
        "INVALID_STATE"
    );

    let s = create(&t, BOB, tpl, "first", 600).await;
    assert_eq!(
        (s["warm"].as_bool(), s["state"].as_str()),
        (Some(true), Some("ready"))
    );
    assert_eq!(s["instanceId"], warm_instance.as_str());
    let claimed = instance(&t, &warm_instance).await;
    assert_eq!(claimed["sandboxId"], s["id"]);
    assert_eq!(claimed["ownerIdentityId"], "id_bob");
    assert!(claimed["claimedAt"].is_string() && claimed.get("warmTemplateId").is_none());
    for m in ["stop", "delete", "start"] {
        let r = t
            .call(
                BOB,
                &format!("instances.{m}"),
                acme_instance(&warm_instance),
            )
            .await;
        assert_eq!(
            code(r),
            "INVALID_STATE",
            "instances.{m} on a sandbox's instance"
        );
    }
    // A replay answers the same sandbox; another request under the key is a conflict.
    assert_eq!(create(&t, BOB, tpl, "first", 600).await["id"], s["id"]);
    let other = t.call(BOB, "sandboxes.create", json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "first", "ttlSeconds": 60 })).await;
    let err = other.unwrap_err();
    assert_eq!(
        (err.body["code"].as_str(), &err.body["details"]["sandboxId"]),
        (Some("CONFLICT"), &s["id"])
    );
    // A template without a warm pool: the create is cold, admitted like instances.create.
    let plain = t.sandbox_template(&pool, "plain", json!({})).await;
    let cold = t.ok(ALICE, "sandboxes.create", json!({ "tenantId": "acme", "templateId": plain["id"], "idempotencyKey": "second", "wait": { "timeoutMs": 20000 } })).await;
    assert_eq!(
        (cold["warm"].as_bool(), cold["state"].as_str()),
        (Some(false), Some("ready"))
    );
    wait_warm(&t, tpl, 1).await; // refilled after the claim
    for (token, key, ttl) in [(ALICE, "x", 0), (ALICE, "y", 86_401)] {
        let r = t.call(token, "sandboxes.create", json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": key, "ttlSeconds": ttl })).await;
        assert_eq!(code(r), "INVALID_INPUT", "ttl {ttl}");
    }
    assert_eq!(
        code(
            t.call(
                EVE,
                "sandboxes.get",
                json!({ "tenantId": "globex", "sandboxId": s["id"] })
            )
            .await
        ),
        "NOT_FOUND"
    );
    let mine = t
        .ok(BOB, "sandboxes.list", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(
        mine["items"].as_array().unwrap().len(),
        1,
        "scope mine is the default"
    );
    let all = t
        .ok(
            BOB,
            "sandboxes.list",
            json!({ "tenantId": "acme", "scope": "all" }),
        )
        .await;
    assert_eq!(all["items"][0]["id"], cold["id"], "newest first: {all}");
    assert_eq!(all["items"][1]["id"], s["id"]);
    let of_tpl = t
        .ok(
            BOB,
            "sandboxes.list",
            json!({ "tenantId": "acme", "scope": "all", "templateId": tpl }),
        )
        .await;
    assert_eq!(
        of_tpl["items"].as_array().unwrap().len(),
        1,
        "templateId filters"
    );
    t.quiescent().await;
    assert!(t.replay_equal().await);
}

/// A one-node pool whose template `name` keeps one warm instance, settled and quiescent: a
/// reconciler pass over the just-settled instance holds its row, and a claim skips a held row
/// (it never waits), so the passes end first. Answers the template id and the host handles.
async fn one_settled_warm_instance(
    t: &TestServer,
    name: &str,
) -> (String, Vec<vps_emulators::host::HostHandle>) {
    let (pool, hosts) = pool_with_hosts(t, 1).await;
    let tpl = t
        .sandbox_template(&pool, name, json!({ "warm": { "min": 1, "max": 1 } }))
        .await;
    let tpl = tpl["id"].as_str().unwrap().to_string();
    wait_warm(t, &tpl, 1).await;
    t.quiescent().await;
    (tpl, hosts)
}

/// A text column of a template's one warm instance.
async fn of_the_warm_instance(t: &TestServer, tpl: &str, column: &str) -> String {
    sqlx::query_scalar(&format!(
        "SELECT {column} FROM instances WHERE warm_template_id = $1"
    ))
    .bind(tpl)
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap()
}

/// A claim wakes its own replica's spec long-polls itself rather than through the `pg_notify`
/// echo: given a replica's signals that hear no notification, the claim's node has moved in
/// them by the time the create returns.
#[tokio::test]
async fn a_warm_claim_wakes_its_own_replicas_spec_polls_without_a_notification() {
    let t = server().await;
    let (tpl, _hosts) = one_settled_warm_instance(&t, "local").await;
    let tpl = tpl.as_str();
    let node = of_the_warm_instance(&t, tpl, "node_id").await;
    let signals = std::sync::Arc::new(vps_projections::spec_signals::SpecSignals::default());
    let wake = signals.subscribe(&node);
    let ctx = vps_commands::Ctx {
        spec_signals: signals.clone(),
        actor: vps_commands::Actor {
            identity: "id_bob".into(),
            tenant: Some("acme".into()),
            operator: false,
        },
        ..vps_api::server::reactor_ctx(&t.server.state, "test")
    };
    let input = vps_commands::sandboxes::create::CreateSandboxInput {
        tenant_id: "acme".into(),
        template_id: tpl.parse().unwrap(),
        ttl_seconds: Some(600),
        idempotency_key: "local".into(),
        from_snapshot: None,
        on_timeout: None,
        labels: None,
    };
    let allow = vps_commands::sandboxes::create::authorized_before;
    let created = vps_commands::sandboxes::create::create(&ctx, input, &allow)
        .await
        .unwrap();
    assert!(created.sandbox.warm, "a claim, not a cold create");
    assert!(
        wake.has_changed().unwrap(),
        "the claim published its node's generation to its own replica"
    );
}

/// A claim writes its instance's spec entry in its own transaction, so the host resumes it
/// without waiting for the NodeSpec follower; the follower's pass over the claim finds the
/// entry as it wants it and leaves it.
#[tokio::test]
async fn a_warm_claim_writes_its_spec_entry_in_the_claims_own_transaction() {
    let t = server().await;
    let (tpl, _hosts) = one_settled_warm_instance(&t, "inline").await;
    let tpl = tpl.as_str();
    let s = create(&t, BOB, tpl, "inline", 600).await;
    assert_eq!(s["warm"], true);
    let sandbox_id = s["id"].as_str().unwrap();
    let stream = format!("sandbox-{sandbox_id}");
    eventually("the NodeSpec follower past the claim", PATIENCE, || async {
        let past: bool = sqlx::query_scalar(
            "SELECT (c.transaction_id, c.position) >= (e.transaction_id, e.position)
               FROM follower_checkpoints c, events e
              WHERE c.name = 'node-specs' AND e.stream = $1 AND e.version = 1",
        )
        .bind(&stream)
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
        if past {
            Ok(())
        } else {
            Err("behind")
        }
    })
    .await;
    let (desired, same_transaction) = vps_tests::spec_entry_written_with(
        &t.server.state.pool,
        s["instanceId"].as_str().unwrap(),
        &stream,
    )
    .await
    .expect("the claimed instance's entry");
    assert_eq!(desired, "running");
    assert!(
        same_transaction,
        "the entry was written by the claim's transaction and not rewritten since"
    );
}

#[tokio::test]
async fn concurrent_creates_never_share_a_warm_instance() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 4).await;
    let tpl = t
        .sandbox_template(&pool, "burst", json!({ "warm": { "min": 8, "max": 8 } }))
        .await;
    let tpl = tpl["id"].as_str().unwrap().to_string();
    wait_warm(&t, &tpl, 8).await;
    // Hold the pool at these 8: a refill woken by the first claims must not join the burst.
    t.ok(
        ALICE,
        "sandboxTemplates.update",
        json!({ "tenantId": "acme", "templateId": tpl, "warm": { "min": 0, "max": 8 } }),
    )
    .await;
    let creates = (0..32).map(|i| {
        let (t, tpl) = (&t, tpl.clone());
        async move {
            t.ok(
                ALICE,
                "sandboxes.create",
                json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": format!("k{i}") }),
            )
            .await
        }
    });
    let made = futures::future::join_all(creates).await;
    let warm = made.iter().filter(|s| s["warm"] == true).count();
    let instances: HashSet<&str> = made
        .iter()
        .map(|s| s["instanceId"].as_str().unwrap())
        .collect();
    assert_eq!(instances.len(), 32, "no instance is claimed twice");
    assert_eq!((warm, 32 - warm), (8, 24));
    t.quiescent().await;
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_lifetime_ends_with_expiring_once_then_expired_then_deleted_in_order() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1).await;
    let tpl = t.sandbox_template(&pool, "short", json!({})).await;
    // Long enough to be ready before it expires on a loaded machine (at 3 s, with three test
    // runs at once, one sandbox expired first and the order below had no `sandbox.ready`).
    let s = create(&t, ALICE, tpl["id"].as_str().unwrap(), "brief", 6).await;
    assert_eq!(s["state"], "ready", "{s}");
    let id = s["id"].as_str().unwrap();
    eventually("the sandbox deleted by its expiry", PATIENCE, || async {
        let now = sandbox(&t, id).await;
        if now["state"] == "deleted" {
            Ok(now)
        } else {
            Err(now["state"].clone())
        }
    })
    .await;
    assert_eq!(sandbox(&t, id).await["expired"], true);
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.*"], "subject": format!("sandbox/{id}") }),
        )
        .await;
    let types: Vec<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "sandbox.created",
            "sandbox.ready",
            "sandbox.expiring",
            "sandbox.expired",
            "sandbox.deleted"
        ]
    );
    let deleted = &events["items"][4]["data"];
    assert_eq!(
        (deleted["expired"].as_bool(), deleted["templateId"].as_str()),
        (Some(true), tpl["id"].as_str())
    );
    let inst = instance(&t, s["instanceId"].as_str().unwrap()).await;
    assert_eq!(inst["state"], "deleted");
    let history = t
        .ok(ALICE, "instances.history", acme_instance(&s["instanceId"]))
        .await;
    assert!(
        history["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["data"]["sandboxId"] == s["id"]),
        "instance events carry sandboxId"
    );
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn extends_are_bounded_and_one_is_in_flight_at_a_time() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1).await;
    let tpl = t
        .sandbox_template(
            &pool,
            "ext",
            json!({ "maxTtlSeconds": 7200, "defaultTtlSeconds": 600 }),
        )
        .await;
    let s = create(&t, ALICE, tpl["id"].as_str().unwrap(), "e", 600).await;
    let id = s["id"].as_str().unwrap();
    let extend = |body: Value| t.call(ALICE, "sandboxes.extend", merged(acme_sandbox(id), body));
    for body in [
        json!({}),
        json!({ "by": "10m", "until": "2030-01-01T00:00:00Z" }),
        json!({ "by": "3h" }),
        json!({ "by": "soon" }),
        json!({ "by": "31d" }),
    ] {
        assert_eq!(code(extend(body.clone()).await), "INVALID_INPUT", "{body}");
    }
    let before = chrono::DateTime::parse_from_rfc3339(s["expiresAt"].as_str().unwrap()).unwrap();
    let after = extend(json!({ "by": "10m" })).await.unwrap();
    let moved = chrono::DateTime::parse_from_rfc3339(after["expiresAt"].as_str().unwrap()).unwrap();
    assert_eq!(moved - before, chrono::TimeDelta::minutes(10));
    // Concurrent extends: each answer is an extend or a CONFLICT extend-in-flight, and the
    // expiry moved by exactly the extends that were answered.
    let answers = futures::future::join_all((0..8).map(|_| extend(json!({ "by": 60_000 })))).await;
    let mut answered = Vec::new();
    for a in &answers {
        match a {
            Ok(s) => answered.push(
                chrono::DateTime::parse_from_rfc3339(s["expiresAt"].as_str().unwrap()).unwrap(),
            ),
            Err(e) => assert_eq!(
                (
                    e.body["code"].as_str(),
                    e.body["details"]["reason"].as_str()
                ),
                (Some("CONFLICT"), Some("extend-in-flight"))
            ),
        }
    }
    let end = sandbox(&t, id).await;
    let end = chrono::DateTime::parse_from_rfc3339(end["expiresAt"].as_str().unwrap()).unwrap();
    // The expiry is one that an extend decided and answered, never more than they add up to.
    assert_eq!(Some(end), answered.iter().max().copied());
    assert!(end - moved <= chrono::TimeDelta::minutes(answered.len() as i64));
    // One after another, a `by` extends again.
    let again = extend(json!({ "by": 60_000 })).await.unwrap();
    let again = chrono::DateTime::parse_from_rfc3339(again["expiresAt"].as_str().unwrap()).unwrap();
    assert_eq!(again - end, chrono::TimeDelta::minutes(1));
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(id)).await;
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(id)).await; // idempotent
    let r = extend(json!({ "by": "1m" })).await;
    assert_eq!(code(r), "INVALID_STATE");
    eventually("deleted", PATIENCE, || async {
        let now = sandbox(&t, id).await;
        if now["state"] == "deleted" {
            Ok(())
        } else {
            Err(now["state"].clone())
        }
    })
    .await;
}

#[tokio::test]
async fn warm_pools_drain_old_versions_and_the_newest_beyond_max() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 2).await;
    let tpl = t
        .sandbox_template(&pool, "drain", json!({ "warm": { "min": 3, "max": 3 } }))
        .await;
    let tpl = tpl["id"].as_str().unwrap();
    wait_warm(&t, tpl, 3).await;
    let old: HashSet<String> =
        sqlx::query_scalar("SELECT id FROM instances WHERE warm_template_id = $1")
            .bind(tpl)
            .fetch_all(&t.server.state.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    // A new image reshapes the template: every old warm instance goes, new ones come.
    t.ok(OPERATOR, "images.register", json!({ "imageId": "img_next", "url": "https://images.example/next.qcow2", "sha256": "b".repeat(64), "format": "qcow2" })).await;
    let up = t
        .ok(
            ALICE,
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": tpl, "imageId": "img_next" }),
        )
        .await;
    assert_eq!(up["version"], 2);
    wait_warm(&t, tpl, 3).await;
    eventually("the old generation drained", PATIENCE, || async {
        let live: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM instances WHERE warm_template_id = $1 AND state <> 'deleted'",
        )
        .bind(tpl)
        .fetch_all(&t.server.state.pool)
        .await
        .unwrap();
        if live.iter().all(|i| !old.contains(i)) && live.len() == 3 {
            Ok(())
        } else {
            Err(live)
        }
    })
    .await;
    // Lowering max drains the newest first.
    let newest: String = sqlx::query_scalar("SELECT id FROM instances WHERE warm_template_id = $1 AND state <> 'deleted' ORDER BY created_at DESC LIMIT 1")
        .bind(tpl).fetch_one(&t.server.state.pool).await.unwrap();
    t.ok(
        ALICE,
        "sandboxTemplates.update",
        json!({ "tenantId": "acme", "templateId": tpl, "warm": { "min": 2, "max": 2 } }),
    )
    .await;
    eventually("the newest drained", PATIENCE, || async {
        let i = instance(&t, &newest).await;
        if i["desiredState"] == "deleted" {
            Ok(())
        } else {
            Err(i["state"].clone())
        }
    })
    .await;
    // A deleted template's pool drains completely.
    t.ok(
        ALICE,
        "sandboxTemplates.delete",
        json!({ "tenantId": "acme", "templateId": tpl }),
    )
    .await;
    wait_warm(&t, tpl, 0).await;
    t.quiescent().await;
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_policy_caps_a_sandboxs_whole_lifetime_on_create_and_extend() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1).await;
    let tpl = t
        .sandbox_template(&pool, "capped", json!({ "maxTtlSeconds": 86400 }))
        .await;
    let tpl = tpl["id"].as_str().unwrap();
    let text = r#"forbid (principal, action in [Action::"compute:sandboxes:create", Action::"compute:sandboxes:update"], resource is Sandbox) when { resource.ttlSeconds > 3600 || resource.gpus > 0 };"#;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "short-cpu-sandboxes", "text": text }),
    )
    .await;
    let long = t.call(ALICE, "sandboxes.create", json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "long", "ttlSeconds": 7200 })).await;
    let refused = long.unwrap_err();
    assert_eq!(refused.body["code"], "ACCESS_DENIED");
    assert_eq!(
        refused.body["details"]["policyIds"][0],
        "short-cpu-sandboxes"
    );
    let s = t.ok(ALICE, "sandboxes.create", json!({ "tenantId": "acme", "templateId": tpl, "idempotencyKey": "short", "ttlSeconds": 3000 })).await;
    let extend = |by: &str| {
        t.call(
            ALICE,
            "sandboxes.extend",
            json!({ "tenantId": "acme", "sandboxId": s["id"], "by": by }),
        )
    };
    // Small steps add up: the decision is on the whole lifetime after the change.
    extend("5m").await.expect("50 + 5 minutes fit");
    assert_eq!(code(extend("10m").await), "ACCESS_DENIED");
    let now = sandbox(&t, s["id"].as_str().unwrap()).await;
    let lifetime = chrono::DateTime::parse_from_rfc3339(now["expiresAt"].as_str().unwrap())
        .unwrap()
        - chrono::DateTime::parse_from_rfc3339(now["createdAt"].as_str().unwrap()).unwrap();
    assert!(lifetime <= chrono::TimeDelta::hours(1), "{lifetime}");
}

#[tokio::test]
async fn a_warm_pool_beyond_one_pass_fills_without_waiting_for_the_periodic_pass() {
    // Passes come a minute apart: only the template's wake-up and the passes that follow a
    // refill can fill the pool in time.
    let t = TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.sandbox_pass = 60.0;
    })
    .await;
    let (pool, _hosts) = pool_with_hosts(&t, 2).await;
    let min = 3 * vps_commands::sandboxes::warm::REFILL_PER_PASS as i64;
    let tpl = t
        .sandbox_template(&pool, "big", json!({ "warm": { "min": min, "max": min } }))
        .await;
    wait_warm(&t, tpl["id"].as_str().unwrap(), min).await;
}
