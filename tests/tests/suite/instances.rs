//! Hosted instances over HTTP against a real server on its own database.

use serde_json::json;
use vps_tests::{acme_instance, quota, TestServer, ALICE, BOB, EVE, OPERATOR, SSH_KEY};

/// `acme`'s pool in 10.0.0.0/28 with `nodes` nodes and a quota of 10 vCPU.
async fn pool(t: &TestServer, nodes: usize) -> String {
    t.hosted_pool("10.0.0.0/28", nodes, quota(10)).await
}

/// Alice creates an instance of `flavor` in `pool` with idempotency key `key`.
async fn create(t: &TestServer, pool: &str, key: &str, flavor: &str) -> serde_json::Value {
    t.ok(ALICE, "instances.create", create_body(pool, key, flavor))
        .await
}

/// Alice's create of `flavor` in `pool` with key `key`, which must be refused: the answer.
async fn refused(t: &TestServer, pool: &str, key: &str, flavor: &str) -> vps_tests::Answer {
    t.err(ALICE, "instances.create", create_body(pool, key, flavor))
        .await
}

fn create_body(pool_id: &str, key: &str, flavor: &str) -> serde_json::Value {
    json!({ "tenantId": "acme", "poolId": pool_id, "flavor": flavor, "imageId": "img_ubuntu",
            "sshKeys": [SSH_KEY], "idempotencyKey": key })
}

#[tokio::test]
async fn a_create_places_the_instance_charges_quota_and_leases_a_free_address() {
    let t = TestServer::start().await;
    let pool = pool(&t, 2).await;
    let inst = create(&t, &pool, "k1", "small").await;
    assert!(inst["id"].as_str().unwrap().starts_with("inst_"));
    assert_eq!(inst["state"], "provisioning");
    assert_eq!(inst["desiredState"], "running");
    let address: std::net::Ipv4Addr = inst["addresses"][0].as_str().unwrap().parse().unwrap();
    let range = vps_domain::ipam::Ipv4Cidr::parse("10.0.0.0/28").unwrap();
    assert!(
        range.is_host(address) && address != range.default_gateway(),
        "network, broadcast and gateway are never leased: {address}"
    );
    assert!(inst["nodeId"].as_str().unwrap().starts_with("node_"));

    let usage = t
        .ok(
            OPERATOR,
            "pools.usage",
            json!({ "poolId": pool, "tenantId": "acme" }),
        )
        .await;
    let vcpu = usage["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["resource"] == "vcpu")
        .unwrap();
    assert_eq!(
        (vcpu["used"].as_i64(), vcpu["max"].as_i64()),
        (Some(2), Some(10))
    );
    let leases = t
        .ok(OPERATOR, "pools.leases", json!({ "poolId": pool }))
        .await;
    assert_eq!(leases["items"][0]["instanceId"], inst["id"]);

    let history = t
        .ok(ALICE, "instances.history", acme_instance(&inst["id"]))
        .await;
    let types: Vec<&str> = history["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["instance.created", "instance.scheduled"]);
    assert_eq!(history["items"][0]["actor"], "id_alice");
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_second_create_with_the_same_key_returns_the_same_instance_and_a_different_request_conflicts(
) {
    let t = TestServer::start().await;
    let pool = pool(&t, 1).await;
    let first = create(&t, &pool, "same", "small").await;
    let again = create(&t, &pool, "same", "small").await;
    assert_eq!(first["id"], again["id"]);
    assert_eq!(
        first["version"], again["version"],
        "a replay appends nothing"
    );

    let err = refused(&t, &pool, "same", "large").await;
    assert_eq!(err.status_code(), (409, Some("CONFLICT")));
    assert_eq!(err.body["details"]["instanceId"], first["id"]);
    // Another identity's key is its own.
    let bobs = t
        .ok(BOB, "instances.create", create_body(&pool, "same", "small"))
        .await;
    assert_ne!(bobs["id"], first["id"]);
}

#[tokio::test]
async fn admission_refusals_carry_the_right_codes_and_leave_nothing_behind() {
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.0.0.0/29", 1, quota(10)).await;

    assert_a_second_large_exceeds_the_quota(&t, &pool).await;
    assert_unknown_references_and_bad_fields_refused(&t, &pool).await;

    // A pool not offered to the tenant does not exist for it.
    let err = t
        .err(
            EVE,
            "instances.create",
            json!({ "tenantId": "globex", "poolId": pool, "flavor": "small",
        "imageId": "img_ubuntu", "idempotencyKey": "e" }),
        )
        .await;
    assert_eq!(err.body["code"], "NOT_FOUND");

    // The /29 has 5 leasable addresses less the gateway: 4 more instances fit the range...
    let small_pool = t
        .ok(OPERATOR, "pools.usage", json!({ "poolId": pool }))
        .await;
    assert!(small_pool["items"].is_array());
    assert_a_refusal_appends_nothing(&t, &pool).await;
    assert!(t.replay_equal().await);
}

/// One 8-vCPU instance fits a 10-vCPU quota; a second is refused with the numbers.
async fn assert_a_second_large_exceeds_the_quota(t: &TestServer, pool: &str) {
    let created = t
        .call(ALICE, "instances.create", create_body(pool, "big", "large"))
        .await
        .unwrap();
    assert_eq!(created["state"], "provisioning");
    let err = refused(t, pool, "big2", "large").await;
    assert_eq!(err.status_code(), (422, Some("QUOTA_EXCEEDED")));
    assert_eq!(
        err.body["details"],
        json!({ "resource": "vcpu", "requested": 8, "max": 10, "used": 8 })
    );
}

/// An unknown flavor or image is `NOT_FOUND`; a private key as an SSH key and an unknown
/// field are `INVALID_INPUT`, naming the field.
async fn assert_unknown_references_and_bad_fields_refused(t: &TestServer, pool: &str) {
    let mut body = create_body(pool, "k", "tiny");
    let err = t.err(ALICE, "instances.create", body.clone()).await;
    assert_eq!(err.status_code(), (404, Some("NOT_FOUND")));
    body["flavor"] = json!("small");
    body["imageId"] = json!("img_nope");
    assert_eq!(
        t.err(ALICE, "instances.create", body.clone()).await.body["code"],
        "NOT_FOUND"
    );
    body["imageId"] = json!("img_ubuntu");
    body["sshKeys"] = json!(["-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----"]);
    let err = t.err(ALICE, "instances.create", body.clone()).await;
    assert_eq!(err.status_code(), (400, Some("INVALID_INPUT")));
    assert_eq!(err.body["details"]["field"], "sshKeys[0]");
    body["sshKeys"] = json!([SSH_KEY]);
    body["surprise"] = json!(1);
    let err = t.err(ALICE, "instances.create", body.clone()).await;
    assert_eq!(err.body["code"], "INVALID_INPUT");
    assert!(err.body["message"].as_str().unwrap().contains("surprise"));
}

/// A create refused for quota leaves the log as it was.
async fn assert_a_refusal_appends_nothing(t: &TestServer, pool: &str) {
    let events_before = count_events(t).await;
    let err = refused(t, pool, "big2", "large").await;
    assert_eq!(err.body["code"], "QUOTA_EXCEEDED");
    let events_after = count_events(t).await;
    assert_eq!(events_before, events_after, "a refusal appends nothing");
}

async fn count_events(t: &TestServer) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_full_address_range_answers_capacity_unavailable() {
    let t = TestServer::start().await;
    // A /30 has two host addresses; the gateway takes one.
    let pool = t.hosted_pool("10.0.0.0/30", 1, quota(100)).await;
    create(&t, &pool, "a", "small").await;
    let err = refused(&t, &pool, "b", "small").await;
    assert_eq!(err.status_code(), (503, Some("CAPACITY_UNAVAILABLE")));
}

#[tokio::test]
async fn another_tenants_instance_is_not_found() {
    let t = TestServer::start().await;
    let pool = pool(&t, 1).await;
    let inst = create(&t, &pool, "k", "small").await;
    for method in [
        "instances.get",
        "instances.stop",
        "instances.delete",
        "instances.history",
    ] {
        let err = t.err(EVE, method, acme_instance(&inst["id"])).await;
        assert_eq!(err.status_code(), (404, Some("NOT_FOUND")), "{method}");
        let err = t
            .err(
                EVE,
                method,
                json!({ "tenantId": "globex", "instanceId": inst["id"] }),
            )
            .await;
        assert_eq!(err.body["code"], "NOT_FOUND", "{method}");
    }
    let err = t
        .err(
            ALICE,
            "pools.create",
            json!({ "name": "x", "class": "vps-host" }),
        )
        .await;
    assert_eq!(err.body["code"], "ACCESS_DENIED");
    let err = t.err("nobody-token", "instances.get", json!({})).await;
    assert_eq!(err.status_code(), (401, Some("UNAUTHENTICATED")));
}

#[tokio::test]
async fn stop_start_and_delete_set_the_desired_state_and_delete_is_idempotent() {
    let t = TestServer::start().await;
    let pool = pool(&t, 1).await;
    let inst = create(&t, &pool, "k", "small").await;
    let id = acme_instance(&inst["id"]);
    assert_eq!(
        t.ok(ALICE, "instances.stop", id.clone()).await["desiredState"],
        "stopped"
    );
    assert_eq!(
        t.ok(ALICE, "instances.start", id.clone()).await["desiredState"],
        "running"
    );
    let deleting = t.ok(ALICE, "instances.delete", id.clone()).await;
    assert_eq!(
        (
            deleting["state"].as_str(),
            deleting["desiredState"].as_str()
        ),
        (Some("deleting"), Some("deleted"))
    );
    let again = t.ok(ALICE, "instances.delete", id.clone()).await;
    assert_eq!(again["version"], deleting["version"]);
    let err = t.err(ALICE, "instances.start", id.clone()).await;
    assert_eq!(err.body["code"], "INVALID_STATE");
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn resize_is_all_or_nothing() {
    let t = TestServer::start().await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/28",
            1,
            json!({ "vcpu": 9, "memoryGiB": 100, "diskGiB": 1000 }),
        )
        .await;
    let inst = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
        "imageId": "img_ubuntu", "idempotencyKey": "k", "desiredState": "stopped" }),
        )
        .await;
    let body = json!({ "tenantId": "acme", "instanceId": inst["id"], "flavor": "large" });
    // Not stopped yet: the host has not reported.
    let err = t.err(ALICE, "instances.resize", body.clone()).await;
    assert_eq!(err.body["code"], "INVALID_STATE");
    let usage = t
        .ok(OPERATOR, "pools.usage", json!({ "poolId": pool }))
        .await;
    let vcpu = usage["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["resource"] == "vcpu")
        .unwrap()
        .clone();
    assert_eq!(vcpu["used"], 2, "a refused resize charges nothing");
}

/// Operator requests with one bad field each, and the field the refusal must name.
fn bad_operator_inputs(pool: &str) -> Vec<(&'static str, serde_json::Value, &'static str)> {
    vec![
        (
            "pools.setIpPool",
            json!({ "poolId": pool, "cidr": "10.0.0.0/33" }),
            "cidr",
        ),
        (
            "pools.setIpPool",
            json!({ "poolId": pool, "cidr": "not-a-cidr" }),
            "cidr",
        ),
        (
            "pools.create",
            json!({ "name": "p", "class": "mainframe" }),
            "class",
        ),
        (
            "flavors.create",
            json!({ "poolId": pool, "name": "f", "vcpu": -1, "memoryGiB": 1, "diskGiB": 1 }),
            "vcpu",
        ),
        (
            "flavors.create",
            json!({ "poolId": pool, "name": "f", "vcpu": "two", "memoryGiB": 1, "diskGiB": 1 }),
            "vcpu",
        ),
        (
            "pools.offer",
            json!({ "poolId": pool, "tenantId": "acme", "quota": { "cpus": 1 } }),
            "quota.cpus",
        ),
    ]
}

#[tokio::test]
async fn bad_input_names_the_field_and_never_answers_500() {
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.0.0.0/28", 1, json!({ "vcpu": 10 })).await;
    for (method, body, field) in bad_operator_inputs(&pool) {
        let err = t.err(OPERATOR, method, body).await;
        assert_eq!(
            err.status_code(),
            (400, Some("INVALID_INPUT")),
            "{method}: {}",
            err.body
        );
        assert_eq!(
            err.body["details"]["field"], field,
            "{method}: {}",
            err.body
        );
    }
    let response = post_raw_pools_create(&t, NOT_JSON).await;
    assert_eq!(response.status().as_u16(), 400);
    let response = post_raw_pools_create(&t, vec![b' '; 3 * 1024 * 1024]).await;
    assert_eq!(response.status().as_u16(), 400);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["code"], "INVALID_INPUT");
}

/// A body that opens a JSON object and never closes it.
const NOT_JSON: &str = "{ not json";

/// `pools.create` as the operator with `body` as it is, not necessarily JSON.
async fn post_raw_pools_create(
    t: &TestServer,
    body: impl Into<reqwest::Body>,
) -> reqwest::Response {
    t.http
        .post(format!("{}/api/compute/pools/create", t.server.url()))
        .bearer_auth(OPERATOR)
        .body(body)
        .send()
        .await
        .unwrap()
}

/// SPEC's race: 64 concurrent creates against a quota of 10 vCPU and a /28.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_never_exceed_quota_leases_or_capacity() {
    let t = std::sync::Arc::new(TestServer::start().await);
    let pool = pool(&t, 2).await;
    let mut tasks = Vec::new();
    for n in 0..64 {
        let (t, pool) = (t.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            t.call(
                ALICE,
                "instances.create",
                create_body(&pool, &format!("race-{n}"), "small"),
            )
            .await
        }));
    }
    let mut created = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(_) => created += 1,
            Err(e) => assert_eq!(e.body["code"], "QUOTA_EXCEEDED", "{}", e.body),
        }
    }
    assert_eq!(created, 5, "10 vCPU of quota hold five 2-vCPU instances");
    let db = &t.server.state.pool;
    let used: i64 = sqlx::query_scalar("SELECT used FROM quotas WHERE resource = 'vcpu'")
        .fetch_one(db)
        .await
        .unwrap();
    assert_eq!(used, 10);
    let leases: i64 = sqlx::query_scalar("SELECT count(DISTINCT address) FROM ip_leases")
        .fetch_one(db)
        .await
        .unwrap();
    assert_eq!(leases, 5);
    let over: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT n.id FROM nodes n JOIN node_allocations a ON a.node_id = n.id
          GROUP BY n.id, n.capacity HAVING sum(a.vcpu) > (n.capacity->>'vcpu')::bigint) x",
    )
    .fetch_one(db)
    .await
    .unwrap();
    assert_eq!(over, 0);
    assert!(t.replay_equal().await);
}

/// Two replicas admit creates in their own batches and race for one node: each batch holds the
/// node's row lock from before it books the node to its commit and checks the node after its
/// writes, so the node is never overbooked; a batch that lost the race decides again, and what
/// does not fit waits in `scheduling`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_racing_for_one_node_never_overbook_it() {
    let t = std::sync::Arc::new(
        TestServer::start_with(|c| c.timings.unschedulable_retry = 600.0).await,
    );
    let replica = t.replica().await;
    let quota = json!({ "vcpu": 1000, "memoryGiB": 1000, "diskGiB": 10000 });
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota).await;
    let urls = [t.server.url(), replica.url()];
    let mut tasks = Vec::new();
    for n in 0..32 {
        let (t, url) = (t.clone(), urls[n % 2].clone());
        let body = create_body(&pool, &format!("node-race-{n}"), "small");
        tasks.push(tokio::spawn(async move {
            t.call_at(&url, ALICE, "instances.create", body)
                .await
                .expect("instances.create answers 200")
        }));
    }
    let mut placed = 0;
    for task in tasks {
        let instance = task.await.unwrap();
        match instance["nodeId"].is_string() {
            true => placed += 1,
            false => assert_eq!(instance["state"], "scheduling", "{instance}"),
        }
    }
    assert_eq!(placed, 8, "a 16-vCPU node holds eight 2-vCPU instances");
    let booked: i64 = sqlx::query_scalar("SELECT sum(vcpu)::bigint FROM node_allocations")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    assert_eq!(booked, 16);
    replica.shutdown().await;
    assert!(t.replay_equal().await);
}

/// The log orders events by transaction id, not by commit: a transaction that got its id
/// before an address was released must not lease it, or the replayed lease would come before
/// the release. The claim skips an address freed by a newer transaction; a later transaction
/// takes it.
#[tokio::test]
async fn an_address_freed_by_a_newer_transaction_is_not_claimed_by_an_older_one() {
    use sqlx::Connection;
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.0.0.0/29", 0, json!({ "vcpu": 10 })).await;
    let db = &t.server.state.pool;
    let free = |p: (
        vps_domain::instance::AdmissionPool,
        vps_domain::instance::AdmissionFacts,
    )| { p.1.free_address.map(|a| a.to_string()) };
    sqlx::query("DELETE FROM ip_free WHERE pool_id = $1 AND address <> '10.0.0.2'")
        .bind(&pool)
        .execute(db)
        .await
        .unwrap();
    let mut older = db.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *older)
        .await
        .unwrap();
    // Leased and released again by a transaction newer than `older`.
    let mut newer = db.acquire().await.unwrap();
    let mut release = newer.begin().await.unwrap();
    for statement in [
        "DELETE FROM ip_free WHERE pool_id = $1",
        "INSERT INTO ip_free (pool_id, address) VALUES ($1, '10.0.0.2')",
    ] {
        sqlx::query(statement)
            .bind(&pool)
            .execute(&mut *release)
            .await
            .unwrap();
    }
    release.commit().await.unwrap();
    let placed = vps_commands::instances::facts::placement(&mut older, &pool)
        .await
        .unwrap();
    assert_eq!(free(placed), None);
    older.rollback().await.unwrap();
    let mut later = db.begin().await.unwrap();
    let placed = vps_commands::instances::facts::placement(&mut later, &pool)
        .await
        .unwrap();
    assert_eq!(free(placed).as_deref(), Some("10.0.0.2"));
}

/// Placement sums a node's GPU allocations per model: on a node with two GPUs of one model, two
/// one-GPU instances book both, and a third waits for room instead of being placed there.
#[tokio::test]
async fn gpus_of_one_model_are_summed_on_their_node() {
    let t = TestServer::start_with(|c| c.timings.unschedulable_retry = 600.0).await;
    let quota = json!({ "vcpu": 100, "memoryGiB": 1000, "diskGiB": 10000, "gpu": 8 });
    let pool = t.hosted_pool("10.0.0.0/28", 0, quota).await;
    let capacity = json!({ "vcpu": 16, "memoryGiB": 64, "diskGiB": 500,
                           "gpus": [{ "model": "h100", "count": 2 }] });
    let node = t
        .ok(
            OPERATOR,
            "nodes.register",
            json!({ "poolId": pool, "name": "gpu-host", "capacity": capacity }),
        )
        .await;
    let flavor = json!({ "poolId": pool, "name": "gpu", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20,
                         "gpus": { "model": "h100", "count": 1 } });
    t.ok(OPERATOR, "flavors.create", flavor).await;
    for key in ["first", "second"] {
        let placed = create(&t, &pool, key, "gpu").await;
        assert_eq!(placed["nodeId"], node["node"]["id"], "{placed}");
    }
    let third = create(&t, &pool, "third", "gpu").await;
    assert_eq!(third["state"], "scheduling", "{third}");
    assert_eq!(third["nodeId"], serde_json::Value::Null, "{third}");
}

/// The admitter places on node rows it read for an earlier batch (for up to a second). A node
/// cordoned since is not used: the locked row no longer matches what placement saw, and the
/// batch is decided again on rows read afresh, which also see a node registered since.
#[tokio::test]
async fn a_node_cordoned_since_its_row_was_kept_is_not_used() {
    let t = TestServer::start().await;
    let quota = json!({ "vcpu": 1000, "memoryGiB": 1000, "diskGiB": 10000 });
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota).await;
    let (a, _) = t.register_node(&pool, "host-a").await;
    let first = create(&t, &pool, "first", "small").await;
    assert_eq!(first["nodeId"], a.as_str(), "{first}");
    t.ok(OPERATOR, "nodes.cordon", json!({ "nodeId": a })).await;
    let (b, _) = t.register_node(&pool, "host-b").await;
    let second = create(&t, &pool, "second", "small").await;
    assert_eq!(second["nodeId"], b.as_str(), "{second}");
}

/// Room freed since the admitter kept a node's row (a deleted instance's allocation) is used at
/// once: a create the kept rows leave unplaced is decided again on rows read afresh.
#[tokio::test]
async fn room_freed_since_a_nodes_row_was_kept_is_used_at_once() {
    let t = TestServer::start().await;
    let quota = json!({ "vcpu": 1000, "memoryGiB": 1000, "diskGiB": 10000 });
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let mut ids = Vec::new();
    // Two 8-vCPU instances fill the 16-vCPU node.
    for key in ["one", "two"] {
        let i = create(&t, &pool, key, "large").await;
        assert_eq!(i["nodeId"], node.as_str(), "{i}");
        ids.push(i["id"].as_str().unwrap().to_string());
    }
    t.ok(ALICE, "instances.delete", acme_instance(&ids[0]))
        .await;
    // The host no longer holds the first: it is deleted and its room released.
    let report = json!({ "nodeId": node, "complete": true,
                         "instances": [{ "id": ids[1], "state": "RUNNING" }] });
    t.ok(&token, "nodes.report", report).await;
    let gone = t.ok(ALICE, "instances.get", acme_instance(&ids[0])).await;
    assert_eq!(gone["state"], "deleted", "{gone}");
    let third = create(&t, &pool, "three", "large").await;
    assert_eq!(third["nodeId"], node.as_str(), "{third}");
    assert_eq!(third["state"], "provisioning", "{third}");
}
