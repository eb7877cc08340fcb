//! Nothing stays stuck (issue 40) over HTTP against a real server with emulated hosts and a
//! manual clock: instance deadlines (`[timings] deadline_instance_<state>`), and force deletes
//! of instances and sandboxes on a host that stopped reporting. Whatever ends this way leaves
//! nothing held: no address, no node allocation, no quota.

use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_instance, quota, TestServer, ALICE, OPERATOR, PATIENCE, SSH_KEY};

const BOOT: Duration = Duration::from_millis(50);

async fn server(adjust: impl FnOnce(&mut vps_api::config::Config)) -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        adjust(c);
    })
    .await
}

async fn pool_with_host(t: &TestServer) -> (String, HostHandle) {
    let (pool, mut hosts) = t.pool_with_hosts("10.0.0.0/22", quota(1000), 1, BOOT).await;
    (pool, hosts.remove(0))
}

async fn create(t: &TestServer, pool: &str, key: &str) -> String {
    let inst = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
                    "imageId": "img_ubuntu", "sshKeys": [SSH_KEY], "idempotencyKey": key }),
        )
        .await;
    inst["id"].as_str().unwrap().to_string()
}

async fn running(t: &TestServer, pool: &str, key: &str) -> String {
    let id = create(t, pool, key).await;
    let inst = t
        .until(ALICE, "acme", &id, PATIENCE, |i| i["state"] == "running")
        .await;
    assert_eq!(inst["state"], "running", "{inst}");
    id
}

async fn reaches(t: &TestServer, id: &str, state: &str) -> Value {
    let inst = t
        .until(ALICE, "acme", id, PATIENCE, |i| i["state"] == state)
        .await;
    assert_eq!(inst["state"], state, "{inst}");
    inst
}

async fn history(t: &TestServer, id: &str) -> Vec<Value> {
    let h = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    h["items"].as_array().unwrap().clone()
}

fn find<'a>(events: &'a [Value], event_type: &str) -> &'a Value {
    events
        .iter()
        .rev()
        .find(|e| e["type"] == event_type)
        .unwrap_or_else(|| panic!("no {event_type} in {events:#?}"))
}

/// What the tenant and the pool still hold: (leased addresses, node allocations, vCPU quota
/// used).
async fn held(t: &TestServer, pool: &str) -> (usize, i64, i64) {
    let leases = t
        .ok(OPERATOR, "pools.leases", json!({ "poolId": pool }))
        .await;
    let db = &t.server.state.pool;
    let allocations: i64 = sqlx::query_scalar("SELECT count(*) FROM node_allocations")
        .fetch_one(db)
        .await
        .unwrap();
    let vcpu: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(used), 0)::bigint FROM quotas
          WHERE pool_id = $1 AND tenant_id = 'acme' AND resource = 'vcpu'",
    )
    .bind(pool)
    .fetch_one(db)
    .await
    .unwrap();
    (leases["items"].as_array().unwrap().len(), allocations, vcpu)
}

#[tokio::test]
async fn an_instance_stuck_provisioning_on_a_silent_host_fails_at_its_deadline_and_releases_everything(
) {
    let t = server(|c| c.timings.deadline_instance_provisioning = 30.0).await;
    let (pool, host) = pool_with_host(&t).await;
    let kept = running(&t, &pool, "kept").await;
    let before = held(&t, &pool).await;
    // The host goes silent: a new instance is placed on it and never hears back.
    host.set_reporting(false);
    let stuck = create(&t, &pool, "stuck").await;
    assert_eq!(
        reaches(&t, &stuck, "provisioning").await["state"],
        "provisioning"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        t.ok(ALICE, "instances.get", acme_instance(&stuck)).await["state"],
        "provisioning",
        "nothing happens before the deadline"
    );
    t.advance(Duration::from_secs(31));
    reaches(&t, &stuck, "deleted").await;
    let events = history(&t, &stuck).await;
    assert_eq!(
        find(&events, "instance.failed")["data"]["reason"],
        "deadline:provisioning"
    );
    assert_eq!(
        find(&events, "instance.deleting")["data"]["reason"],
        "deadline:provisioning"
    );
    find(&events, "instance.deleted");
    assert_eq!(
        held(&t, &pool).await,
        before,
        "everything the stuck instance held is free"
    );
    // The instance that was fine is untouched.
    assert_eq!(
        t.ok(ALICE, "instances.get", acme_instance(&kept)).await["state"],
        "running"
    );
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn an_instance_stuck_deleting_on_a_silent_host_is_released_at_its_deadline() {
    let t = server(|c| c.timings.deadline_instance_deleting = 30.0).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let id = running(&t, &pool, "doomed").await;
    host.set_reporting(false);
    t.ok(ALICE, "instances.delete", acme_instance(&id)).await;
    assert_eq!(reaches(&t, &id, "deleting").await["state"], "deleting");
    t.advance(Duration::from_secs(31));
    reaches(&t, &id, "deleted").await;
    let events = history(&t, &id).await;
    assert_eq!(
        find(&events, "instance.deleting")["data"]["reason"],
        "deadline:deleting"
    );
    assert_eq!(held(&t, &pool).await, empty);
    assert!(t.replay_equal().await);
}
