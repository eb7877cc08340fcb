//! Hosts converge instances: the real server, its reconciler and emulated hosts over HTTP.

use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::DomainState;
use vps_tests::{acme_instance, quota, TestServer, ALICE, OPERATOR, SSH_KEY};

const BOOT: Duration = Duration::from_millis(100);
const WAIT: Duration = Duration::from_secs(20);

async fn fast_server() -> TestServer {
    TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        c.timings.unschedulable_retry = 0.2;
        c.timings.replacement_wait = 0.3;
        c.timings.lost_look = 0.2;
        c.timings.liveness_check = 0.1;
    })
    .await
}

/// A hosted pool (no nodes) offered to acme with plenty of quota.
async fn pool(t: &TestServer) -> String {
    t.hosted_pool("10.0.0.0/24", 0, quota(1000)).await
}

async fn create(t: &TestServer, pool: &str, key: &str) -> String {
    let inst = create_of(t, pool, "small", key).await;
    inst["id"].as_str().unwrap().to_string()
}

/// Alice's create of `flavor` in `pool`, answered as it is.
async fn create_of(t: &TestServer, pool: &str, flavor: &str, key: &str) -> Value {
    t.ok(
        ALICE,
        "instances.create",
        json!({ "tenantId": "acme", "poolId": pool, "flavor": flavor,
        "imageId": "img_ubuntu", "sshKeys": [SSH_KEY], "idempotencyKey": key }),
    )
    .await
}

fn state(s: &'static str) -> impl Fn(&Value) -> bool {
    move |i| i["state"] == s
}

async fn history(t: &TestServer, id: &str) -> Vec<String> {
    let h = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    h["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_runs_stops_starts_and_is_deleted_only_after_a_complete_report() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let host = t.host(&node, &token, BOOT);
    let id = create(&t, &pool, "k").await;

    let running = t.until(ALICE, "acme", &id, WAIT, state("running")).await;
    assert_eq!(running["state"], "running", "{running}");
    let leased = running["addresses"][0].as_str().unwrap();
    assert!(
        leased.starts_with("10.0.0.") && leased != "10.0.0.1",
        "{leased}"
    );
    let domain = host.domain(&id).expect("the host runs it");
    assert!(
        domain
            .user_data
            .unwrap_or_default()
            .contains("#cloud-config"),
        "user data reached the host"
    );

    let req = acme_instance(&id);
    t.ok(ALICE, "instances.stop", req.clone()).await;
    assert_eq!(
        t.until(ALICE, "acme", &id, WAIT, state("stopped")).await["state"],
        "stopped"
    );
    t.ok(ALICE, "instances.start", req.clone()).await;
    assert_eq!(
        t.until(ALICE, "acme", &id, WAIT, state("running")).await["state"],
        "running"
    );

    t.ok(ALICE, "instances.delete", req.clone()).await;
    let deleted = t.until(ALICE, "acme", &id, WAIT, state("deleted")).await;
    assert_eq!(deleted["state"], "deleted");
    assert!(host.domain(&id).is_none(), "the host destroyed it");
    t.specs_caught_up().await;
    let spec = t
        .ok(OPERATOR, "nodes.spec", json!({ "nodeId": node }))
        .await;
    assert_eq!(spec["instances"], json!([]));
    let leases = t
        .ok(OPERATOR, "pools.leases", json!({ "poolId": pool }))
        .await;
    assert_eq!(leases["items"], json!([]));
    let usage = t
        .ok(OPERATOR, "pools.usage", json!({ "poolId": pool }))
        .await;
    assert!(
        usage["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["used"] == 0),
        "{usage}"
    );
    let h = history(&t, &id).await;
    assert_eq!(h.first().map(String::as_str), Some("instance.created"));
    assert_eq!(h.last().map(String::as_str), Some("instance.deleted"));
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_error_fails_the_instance_with_a_runtime_error_condition() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let host = t.host(&node, &token, BOOT);
    let id = create(&t, &pool, "k").await;
    t.until(ALICE, "acme", &id, WAIT, state("running")).await;
    host.fail_instance(&id, "qemu crashed");
    let failed = t.until(ALICE, "acme", &id, WAIT, state("error")).await;
    assert_eq!(failed["state"], "error");
    let condition = failed["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "RuntimeError")
        .cloned();
    assert_eq!(condition.expect("RuntimeError")["message"], "qemu crashed");
    assert!(history(&t, &id)
        .await
        .contains(&"instance.failed".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_host_is_left_for_another_after_the_wait() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (a, ta) = t.register_node(&pool, "host-a").await;
    let host_a = t.host(&a, &ta, BOOT);
    host_a.refuse_new(Some("no hugepages".into()));
    let id = create(&t, &pool, "k").await;
    let refused = t
        .until(ALICE, "acme", &id, WAIT, |i| {
            i["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "HostResourcesExhausted"))
        })
        .await;
    assert_eq!(refused["nodeId"], a.as_str(), "{refused}");
    let (b, tb) = t.register_node(&pool, "host-b").await;
    let _host_b = t.host(&b, &tb, BOOT);
    let running = t
        .until(ALICE, "acme", &id, WAIT, |i| {
            i["state"] == "running" && i["nodeId"] == b.as_str()
        })
        .await;
    assert_eq!(
        (running["state"].as_str(), running["nodeId"].as_str()),
        (Some("running"), Some(b.as_str())),
        "{running}"
    );
    assert!(history(&t, &id)
        .await
        .contains(&"instance.recreating".to_string()));
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_refused_by_four_hosts_fails() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let hosts = t.hosts(&pool, 4, BOOT).await;
    for host in &hosts {
        host.refuse_new(Some("no memory".into()));
    }
    let id = create(&t, &pool, "k").await;
    let failed = t.until(ALICE, "acme", &id, WAIT, state("error")).await;
    assert_eq!(failed["state"], "error", "{failed}");
    let h = history(&t, &id).await;
    assert_eq!(
        h.iter().filter(|t| *t == "instance.recreating").count(),
        3,
        "{h:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_loses_its_instances_and_they_recover_when_it_reports_again() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    t.ok(
        OPERATOR,
        "pools.update",
        json!({ "poolId": pool, "policy": { "lostAfterSeconds": 1 } }),
    )
    .await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let host = t.host(&node, &token, BOOT);
    let id = create(&t, &pool, "k").await;
    t.until(ALICE, "acme", &id, WAIT, state("running")).await;
    host.set_reporting(false);
    // Silent for longer than lostAfterSeconds.
    t.advance(Duration::from_secs(2));
    assert_eq!(
        t.until(ALICE, "acme", &id, WAIT, state("lost")).await["state"],
        "lost"
    );
    assert_eq!(
        t.ok(OPERATOR, "nodes.get", json!({ "nodeId": node })).await["state"],
        "lost"
    );
    host.set_reporting(true);
    assert_eq!(
        t.until(ALICE, "acme", &id, WAIT, state("running")).await["state"],
        "running"
    );
    assert!(history(&t, &id)
        .await
        .contains(&"instance.recovered".to_string()));
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_recreate_on_host_loss_a_lost_hosts_instances_move_to_another_node() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    t.ok(
        OPERATOR,
        "pools.update",
        json!({ "poolId": pool, "policy": { "lostAfterSeconds": 1, "recreateOnHostLoss": true } }),
    )
    .await;
    let (a, ta) = t.register_node(&pool, "host-a").await;
    let host_a = t.host(&a, &ta, BOOT);
    let id = create(&t, &pool, "k").await;
    t.until(ALICE, "acme", &id, WAIT, state("running")).await;
    let (b, tb) = t.register_node(&pool, "host-b").await;
    let _host_b = t.host(&b, &tb, BOOT);
    host_a.set_reporting(false);
    let moved = t
        .until(ALICE, "acme", &id, WAIT, |i| {
            i["state"] == "running" && i["nodeId"] == b.as_str()
        })
        .await;
    assert_eq!(moved["nodeId"], b.as_str(), "{moved}");
    assert!(history(&t, &id)
        .await
        .contains(&"instance.recreating".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_are_returned_sorted_and_announced_only_when_the_set_changes() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let report = |ids: &[&str]| {
        json!({ "nodeId": node, "complete": true,
                "instances": ids.iter().map(|i| json!({ "id": i, "state": "RUNNING" })).collect::<Vec<_>>() })
    };
    let answer = t
        .ok(&token, "nodes.report", report(&["inst_zz", "inst_aa"]))
        .await;
    assert_eq!(answer["orphans"], json!(["inst_aa", "inst_zz"]));
    t.ok(&token, "nodes.report", report(&["inst_aa", "inst_zz"]))
        .await;
    t.ok(&token, "nodes.report", report(&["inst_aa"])).await;
    t.settle().await;
    let events = t
        .ok(
            OPERATOR,
            "events.list",
            json!({ "types": ["instance.orphaned"] }),
        )
        .await;
    let sets: Vec<Value> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["data"]["instanceIds"].clone())
        .collect();
    assert_eq!(
        sets,
        vec![json!(["inst_aa", "inst_zz"]), json!(["inst_aa"])]
    );
    assert_eq!(events["items"][0]["subject"], format!("node/{node}"));
    // Another node's token cannot speak for this node.
    let (_, other) = t.register_node(&pool, "host-b").await;
    let err = t.err(&other, "nodes.report", report(&[])).await;
    assert_eq!(err.body["code"], "ACCESS_DENIED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reads_user_data_only_for_instances_placed_on_it() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (a, ta) = t.register_node(&pool, "host-a").await;
    let id = create(&t, &pool, "k").await;
    let (_b, tb) = t.register_node(&pool, "host-b").await;
    let reference = format!("secret://{id}");
    let value = t
        .ok(
            &ta,
            "nodes.secret",
            json!({ "nodeId": a, "ref": reference }),
        )
        .await;
    assert!(value["value"].as_str().unwrap().contains(SSH_KEY));
    let err = t
        .err(
            &tb,
            "nodes.secret",
            json!({ "nodeId": a, "ref": reference }),
        )
        .await;
    assert_eq!(err.body["code"], "ACCESS_DENIED");
    let err = t
        .err(
            OPERATOR,
            "nodes.secret",
            json!({ "nodeId": a, "ref": reference }),
        )
        .await;
    assert_eq!(err.body["code"], "ACCESS_DENIED");
    // User data is in no event and no view.
    let events = t
        .ok(OPERATOR, "events.list", json!({ "limit": 1000 }))
        .await;
    assert!(!events.to_string().contains("cloud-config"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_request_waits_for_a_newer_generation() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let first = t.ok(&token, "nodes.spec", json!({ "nodeId": node })).await;
    assert_eq!(first["generation"], 0);
    let waiting = {
        let (node, token) = (node.clone(), token.clone());
        let t = &t;
        async move {
            let started = std::time::Instant::now();
            let spec = t
                .ok(
                    &token,
                    "nodes.spec",
                    json!({ "nodeId": node, "afterGeneration": 0, "waitMs": 10000 }),
                )
                .await;
            (spec, started.elapsed())
        }
    };
    let creating = async {
        // Not a wait for a condition: the delay under test, that the long poll holds across.
        tokio::time::sleep(Duration::from_millis(300)).await;
        create(&t, &pool, "k").await
    };
    let ((spec, waited), id) = tokio::join!(waiting, creating);
    assert_eq!(spec["generation"], 1);
    assert_eq!(spec["instances"][0]["id"], id.as_str());
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(9),
        "{waited:?}"
    );
    let nic = &spec["instances"][0]["nics"][0];
    let leased = t.ok(ALICE, "instances.get", acme_instance(&id)).await;
    assert_eq!(
        nic["address"],
        format!("{}/24", leased["addresses"][0].as_str().unwrap())
    );
    assert!(nic["mac"].as_str().unwrap().starts_with("02:"));
    let unchanged = t
        .ok(
            &token,
            "nodes.spec",
            json!({ "nodeId": node, "afterGeneration": 1, "waitMs": 200 }),
        )
        .await;
    assert_eq!(
        unchanged["generation"], 1,
        "the generation moves only with the content"
    );
}

#[tokio::test]
async fn domain_states_are_reported_by_the_emulated_host() {
    // The emulator's own API is what the scenario tests rely on.
    assert_ne!(DomainState::Running, DomainState::Stopped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_database_share_the_work() {
    let t = fast_server().await;
    let replica = t.replica().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    // The host talks to the replica; the tenant to the first server.
    let mut config =
        vps_emulators::host::HostConfig::new(replica.url(), node.clone(), token.clone());
    config.boot_delay = BOOT;
    config.report_interval = Duration::from_millis(200);
    let _host = vps_emulators::host::EmulatedHost::start(config);
    let mut ids = Vec::new();
    // Eight 2-vCPU instances fill the 16-vCPU node.
    for k in 0..8 {
        ids.push(create(&t, &pool, &format!("r{k}")).await);
    }
    for id in &ids {
        assert_eq!(
            t.until(ALICE, "acme", id, WAIT, state("running")).await["state"],
            "running"
        );
        let h = history(&t, id).await;
        let running = h.iter().filter(|t| *t == "instance.running").count();
        assert_eq!(running, 1, "{id}: {h:?}");
    }
    let failures: i64 =
        sqlx::query_scalar("SELECT count(*) FROM work_items WHERE last_error IS NOT NULL")
            .fetch_one(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!(failures, 0);
    replica.shutdown().await;
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unschedulable_instance_is_placed_as_soon_as_a_node_is_added() {
    // The periodic retry is far away: only the wake-up on new capacity can place it in time.
    let t = TestServer::start_with(|c| c.timings.unschedulable_retry = 600.0).await;
    let pool = pool(&t).await;
    let id = create(&t, &pool, "k").await;
    let waiting = t.ok(ALICE, "instances.get", acme_instance(&id)).await;
    assert_eq!(waiting["state"], "scheduling");
    assert_eq!(waiting["conditions"][0]["type"], "Unschedulable");
    assert_eq!(waiting["conditions"][0]["reason"], "NoFit");
    let (node, _) = t.register_node(&pool, "late").await;
    let placed = t
        .until(
            ALICE,
            "acme",
            &id,
            Duration::from_secs(10),
            state("provisioning"),
        )
        .await;
    assert_eq!(placed["nodeId"], node.as_str(), "{placed}");
    assert_eq!(placed["conditions"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_waits_only_on_the_instances_it_changes() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let (a, b) = (create(&t, &pool, "a").await, create(&t, &pool, "b").await);
    for id in [&a, &b] {
        t.until(ALICE, "acme", id, WAIT, |i| i["nodeId"] == node.as_str())
            .await;
    }
    let report = |b_state: &str| {
        json!({ "nodeId": node, "complete": true, "instances": [
            { "id": a, "state": "RUNNING" },
            { "id": b, "state": b_state, "message": "the disk is gone" } ] })
    };
    t.ok(&token, "nodes.report", report("RUNNING")).await;
    for id in [&a, &b] {
        t.until(ALICE, "acme", id, WAIT, state("running")).await;
    }
    // Another transaction holds a's row (a claim or a change in flight); the report leaves a
    // as it is and changes b, so it must not wait for that transaction.
    let mut holder = t.server.state.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE")
        .bind(&a)
        .execute(&mut *holder)
        .await
        .unwrap();
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        t.ok(&token, "nodes.report", report("ERROR")),
    )
    .await
    .expect("the report waited for a's row, which it does not change");
    assert_eq!(answer["updated"], 1, "{answer}");
    holder.rollback().await.unwrap();
}

/// The work items of `id` once the server is quiescent.
async fn items_after_quiet(t: &TestServer, id: &str) -> i64 {
    t.quiescent().await;
    sqlx::query_scalar("SELECT count(*) FROM work_items WHERE key = $1")
        .bind(id)
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
}

/// The waker wakes an instance only when a pass could act: a placed instance on its way to
/// running, and then running, never gets a work item; one that nothing fits gets one (its
/// retry). The looks are far apart, so an item made by a wake-up would still be there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_instance_a_pass_could_act_on_is_woken() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 600.0;
        c.timings.unschedulable_retry = 600.0;
    })
    .await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let placed = create(&t, &pool, "placed").await;
    assert_eq!(
        items_after_quiet(&t, &placed).await,
        0,
        "a provisioning instance woke a pass"
    );
    let report = json!({ "nodeId": node, "complete": true,
                         "instances": [{ "id": placed, "state": "RUNNING" }] });
    t.ok(&token, "nodes.report", report).await;
    t.until(ALICE, "acme", &placed, WAIT, state("running"))
        .await;
    assert_eq!(
        items_after_quiet(&t, &placed).await,
        0,
        "a running instance woke a pass"
    );

    // Bigger than the node: nothing fits, so the reconciler must look again.
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool, "name": "huge", "vcpu": 32, "memoryGiB": 64, "diskGiB": 20 }),
    )
    .await;
    let huge = create_of(&t, &pool, "huge", "huge").await;
    assert_eq!(huge["state"], "scheduling", "{huge}");
    let huge = huge["id"].as_str().unwrap().to_string();
    assert_eq!(
        items_after_quiet(&t, &huge).await,
        1,
        "a scheduling instance has no retry"
    );
}

/// A reconcile pass over an instance that needs nothing takes no lock: it reads and decides
/// without one (a row lock is written to the WAL, so each such pass used to commit with a
/// flush), so a transaction holding the row does not hold the pass up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_over_a_settled_instance_takes_no_row_lock() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let _host = t.host(&node, &token, BOOT);
    let id = create(&t, &pool, "settled").await;
    t.until(ALICE, "acme", &id, WAIT, state("running")).await;
    let mut holder = t.server.state.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE")
        .bind(&id)
        .execute(&mut *holder)
        .await
        .unwrap();
    let state = &t.server.state;
    let ctx = vps_api::server::reactor_ctx(state, "test");
    let item = vps_reactors::work_queue::Taken {
        key: id.clone(),
        wakes: 0,
        attempts: 0,
        lease_id: 0,
        retry_at: None,
    };
    let timings = vps_api::server::timings(&state.config);
    let pass = tokio::time::timeout(
        Duration::from_secs(10),
        vps_reactors::instances::reconcile(&ctx, &timings, &item),
    )
    .await
    .expect("the pass waited for the instance's row lock")
    .unwrap();
    assert_ne!(
        pass.next,
        vps_reactors::work_queue::Next::After(Duration::ZERO),
        "a running instance needs nothing at once"
    );
    holder.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_replica_hears_which_nodes_spec_moved() {
    // The replica runs no NodeSpec follower (the first server holds its lease): it learns a
    // node's new generation only from the follower's announcement, and wakes that node's polls.
    let t = fast_server().await;
    let replica = t.replica().await;
    let pool = pool(&t).await;
    let (node, _) = t.register_node(&pool, "host-a").await;
    let mut moved = replica.state.spec_signals.subscribe(&node);
    create(&t, &pool, "k").await;
    tokio::time::timeout(WAIT, moved.wait_for(|generation| *generation >= 1))
        .await
        .expect("the replica heard the node's generation move")
        .unwrap();
    replica.shutdown().await;
}

/// A report may state the host's CPU model and runtimes and each guest's CPU seconds
/// (SPEC §3.11); each has its shape checked, naming the field, as is each entry's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_states_the_hosts_cpu_model_runtimes_and_guests_cpu_seconds() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "stating").await;
    let report = |extra: Value| {
        let mut body = json!({ "nodeId": node, "instances": [], "complete": false });
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    t.call(
        &token,
        "nodes.report",
        report(json!({ "cpuModel": "tcg:max", "runtimes": ["qemu"] })),
    )
    .await
    .expect("accepted");
    for (extra, field) in [
        (json!({ "runtimes": ["hyperv"] }), "runtimes"),
        (json!({ "cpuModel": "" }), "cpuModel"),
        (
            json!({ "instances": [{ "id": "inst_x", "state": "RUNNING", "cpuSeconds": -1.0 }] }),
            "instances[0].cpuSeconds",
        ),
        // Entries are parsed one by one (a text the node's last report carried is not parsed
        // again): a bad one is still named, by its index.
        (
            json!({ "instances": [{ "id": "inst_x", "state": "RUNNING" }, { "id": "inst_y", "state": "BOGUS" }] }),
            "instances[1].state",
        ),
        (json!({ "instances": [5] }), "instances[0]"),
    ] {
        let refused = t
            .call(&token, "nodes.report", report(extra.clone()))
            .await
            .expect_err("refused");
        assert_eq!(refused.body["code"], "INVALID_INPUT", "{extra}");
        assert_eq!(refused.body["details"]["field"], field, "{extra}");
    }
    // A guest listed twice is refused, also when only what changed since the node's last
    // report (the part of it parsed again) repeats a guest it kept.
    let guest = |id: &str| json!({ "id": id, "state": "RUNNING" });
    for (instances, accepted) in [
        (json!([guest("inst_x"), guest("inst_x")]), false),
        (json!([guest("inst_x"), guest("inst_y")]), true),
        (json!([guest("inst_x"), guest("inst_x")]), false),
    ] {
        let answer = t
            .call(
                &token,
                "nodes.report",
                report(json!({ "instances": instances })),
            )
            .await;
        match answer {
            Ok(_) => assert!(accepted, "{instances}"),
            Err(refused) => {
                assert!(!accepted, "{instances}: {}", refused.body);
                assert_eq!(refused.body["details"]["field"], "instances");
                assert!(
                    refused.body.to_string().contains("twice"),
                    "{}",
                    refused.body
                );
            }
        }
    }
}

#[tokio::test]
async fn a_complete_report_of_ten_thousand_guests_fits_and_one_over_the_limit_keeps_no_node_alive()
{
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    // Ids as long as real ones, each guest with an address and its CPU time: about 1.3 MB,
    // five times the default body limit.
    let guests: Vec<Value> = (0..10_000)
        .map(|i| {
            json!({ "id": format!("inst_{i:052}"), "state": "RUNNING",
                    "addresses": [format!("10.{}.{}.{}", i / 65536, i / 256 % 256, i % 256)],
                    "cpuSeconds": 12.5 })
        })
        .collect();
    let report = json!({ "nodeId": node, "complete": true, "instances": guests });
    assert!(report.to_string().len() > 256 * 1024);
    let answer = t.ok(&token, "nodes.report", report).await;
    // None of them is placed here: all orphans, of which the answer names the first few.
    let orphans = answer["orphans"].as_array().unwrap();
    assert_eq!(orphans[0], format!("inst_{:052}", 0));

    let last_report = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT last_report_at FROM node_heartbeats WHERE node_id = $1",
        )
        .bind(&node)
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
    };
    let before = last_report().await;
    // Over the documented 16 MiB: refused naming the limit, and the node is not kept alive.
    let padding = "x".repeat(17 * 1024 * 1024);
    let oversized = json!({ "nodeId": node, "complete": true,
                            "instances": [{ "id": "inst_a", "state": "RUNNING", "message": padding }] });
    let refused = t.call(&token, "nodes.report", oversized).await.unwrap_err();
    assert_eq!(
        (refused.status, &refused.body["code"]),
        (400, &json!("INVALID_INPUT"))
    );
    let message = refused.body["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
        + &refused.body["details"].to_string();
    assert!(message.contains("16777216"), "{}", refused.body);
    assert_eq!(last_report().await, before);
    // Only a node gets the larger limit; every other method keeps the default one.
    let tenant_report = json!({ "nodeId": node, "instances": [], "complete": false,
                                "cpuModel": "x".repeat(300 * 1024) });
    let refused = t
        .call(ALICE, "nodes.report", tenant_report)
        .await
        .unwrap_err();
    assert!(
        refused.body.to_string().contains("262144"),
        "{}",
        refused.body
    );
    let big_list = json!({ "tenantId": "acme", "state": "x".repeat(300 * 1024) });
    let refused = t.call(ALICE, "instances.list", big_list).await.unwrap_err();
    assert_eq!(refused.body["code"], "INVALID_INPUT");
    assert!(
        refused.body.to_string().contains("262144"),
        "{}",
        refused.body
    );
}

/// The marks a report reads to find which instances changed on its node (`instance_marks`)
/// are pruned for an instance deleted from the node once they are an hour old; the mark of an
/// instance still on the node stays, and the node's reports still change what they report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_marks_of_a_deleted_instance_are_pruned_after_an_hour() {
    let t = fast_server().await;
    let pool = pool(&t).await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let host = t.host(&node, &token, BOOT);
    let gone = create(&t, &pool, "gone").await;
    let kept = create(&t, &pool, "kept").await;
    for id in [&gone, &kept] {
        t.until(ALICE, "acme", id, WAIT, state("running")).await;
    }
    t.ok(ALICE, "instances.delete", acme_instance(&gone)).await;
    t.until(ALICE, "acme", &gone, WAIT, state("deleted")).await;
    let db = t.server.state.pool.clone();
    let marks = |id: String| {
        let db = db.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM instance_marks WHERE instance_id = $1",
            )
            .bind(id)
            .fetch_one(&db)
            .await
            .unwrap()
        }
    };
    assert_eq!(
        marks(gone.clone()).await,
        1,
        "a deleted instance's mark is kept a while"
    );
    assert_eq!(marks(kept.clone()).await, 1);

    t.advance(Duration::from_secs(2 * 3600));
    vps_tests::wait_until("the deleted instance's mark pruned", WAIT, || {
        let count = marks(gone.clone());
        async move { count.await == 0 }
    })
    .await;
    assert_eq!(marks(kept.clone()).await, 1, "a live instance's mark stays");
    // The node's views are read whole after the hour: its reports still act on changes.
    t.ok(ALICE, "instances.stop", acme_instance(&kept)).await;
    t.until(ALICE, "acme", &kept, WAIT, state("stopped")).await;
    assert!(host.domain(&gone).is_none());
    assert!(t.replay_equal().await);
}
