//! The churn acceptance: hundreds of instances on several emulated hosts, created, some
//! stopped and started, all deleted; nothing may leak and replay must equal live.

use std::time::Duration;

use futures::future::join_all;
use serde_json::{json, Value};
use vps_domain::state_table::{allows, InstanceState};
use vps_emulators::host::HostHandle;
use vps_tests::{
    acme_instance, eventually_every, quota, wait_until, TestServer, ALICE, OPERATOR, PATIENCE,
};

const INSTANCES: usize = 200;
const HOSTS: usize = 3;

/// Waits until every instance of `ids` is in state `want`. Each look reads every instance, so
/// it looks less often than the usual poll.
async fn wait_all(t: &TestServer, ids: &[String], want: &str, timeout: Duration) {
    let what = format!("{} instances {want}", ids.len());
    eventually_every(&what, timeout, Duration::from_millis(200), || async {
        let states: Vec<Value> = join_all(
            ids.iter()
                .map(|id| t.ok(ALICE, "instances.get", acme_instance(id))),
        )
        .await;
        match states
            .into_iter()
            .filter(|i| i["state"] != want)
            .collect::<Vec<_>>()
        {
            behind if behind.is_empty() => Ok(()),
            behind => Err(format!("{} behind, e.g. {}", behind.len(), behind[0])),
        }
    })
    .await;
}

/// Registers the big nodes (200 one-vCPU instances fit on three) and starts their hosts.
async fn start_hosts(t: &TestServer, pool: &str) -> Vec<HostHandle> {
    let mut hosts = Vec::new();
    for n in 0..HOSTS {
        let answer = t
            .ok(OPERATOR, "nodes.register", json!({ "poolId": pool, "name": format!("churn-{n}"), "capacity": { "vcpu": 128, "memoryGiB": 1024, "diskGiB": 10000 } }))
            .await;
        hosts.push(t.host(
            answer["node"]["id"].as_str().unwrap(),
            answer["nodeToken"].as_str().unwrap(),
            Duration::from_millis(50),
        ));
    }
    hosts
}

/// Nothing of the deleted instances is left in the projections once NodeSpecs caught up.
async fn assert_nothing_left_behind(t: &TestServer) {
    t.specs_caught_up().await;
    let db = &t.server.state.pool;
    for (table, sql) in [
        ("allocations", "SELECT count(*) FROM node_allocations"),
        ("leases", "SELECT count(*) FROM ip_leases"),
        (
            "quota usage",
            "SELECT coalesce(sum(used), 0)::bigint FROM quotas",
        ),
        ("spec entries", "SELECT count(*) FROM node_spec_entries"),
        ("sealed user data", "SELECT count(*) FROM sealed_secrets"),
    ] {
        let left: i64 = sqlx::query_scalar(sql).fetch_one(db).await.unwrap();
        assert_eq!(left, 0, "{table} left behind");
    }
}

/// Every move in the instance's history is one the state table allows, and it ends deleted.
async fn assert_history_follows_the_state_table(t: &TestServer, id: &str) {
    let h = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    let states: Vec<InstanceState> = h["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| serde_json::from_value(e["data"]["state"].clone()).unwrap())
        .collect();
    for pair in states.windows(2) {
        assert!(
            pair[0] == pair[1] || allows(pair[0], pair[1]),
            "{id}: {:?} → {:?} is not in the state table",
            pair[0],
            pair[1]
        );
    }
    assert_eq!(states.last(), Some(&InstanceState::Deleted));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn churn_leaves_no_allocation_lease_quota_spec_entry_or_domain_behind() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.2;
        c.timings.unschedulable_retry = 0.5;
    })
    .await;
    let pool = t.hosted_pool("10.1.0.0/22", 0, quota(10000)).await;
    let hosts = start_hosts(&t, &pool).await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool, "name": "tiny", "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 }),
    )
    .await;

    let mut ids = Vec::new();
    for chunk in (0..INSTANCES).collect::<Vec<_>>().chunks(20) {
        let created = join_all(chunk.iter().map(|n| {
            t.ok(
                ALICE,
                "instances.create",
                json!({ "tenantId": "acme", "poolId": pool, "flavor": "tiny",
                "imageId": "img_ubuntu", "idempotencyKey": format!("churn-{n}") }),
            )
        }))
        .await;
        ids.extend(
            created
                .iter()
                .map(|i| i["id"].as_str().unwrap().to_string()),
        );
    }
    wait_all(&t, &ids, "running", Duration::from_secs(120)).await;

    let some: Vec<String> = ids.iter().step_by(4).cloned().collect();
    let req = |id: &String| acme_instance(id);
    join_all(some.iter().map(|id| t.ok(ALICE, "instances.stop", req(id)))).await;
    wait_all(&t, &some, "stopped", Duration::from_secs(60)).await;
    join_all(
        some.iter()
            .map(|id| t.ok(ALICE, "instances.start", req(id))),
    )
    .await;
    wait_all(&t, &some, "running", Duration::from_secs(60)).await;

    for chunk in ids.chunks(20) {
        join_all(
            chunk
                .iter()
                .map(|id| t.ok(ALICE, "instances.delete", req(id))),
        )
        .await;
    }
    wait_all(&t, &ids, "deleted", Duration::from_secs(120)).await;

    assert_nothing_left_behind(&t).await;
    // Hosts drop domains on their next spec.
    wait_until("no host holding a domain", PATIENCE, || async {
        hosts.iter().all(|h| h.domains().is_empty())
    })
    .await;

    for id in &ids {
        assert_history_follows_the_state_table(&t, id).await;
    }
    assert!(t.replay_equal().await);
}
