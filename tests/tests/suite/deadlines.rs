//! Nothing stays stuck (issue 40) over HTTP against a real server with emulated hosts and a
//! manual clock: instance deadlines (`[timings] deadline_instance_<state>`), and force deletes
//! of instances and sandboxes on a host that stopped reporting. Whatever ends this way leaves
//! nothing held: no address, no node allocation, no quota.

use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{
    acme_instance, acme_sandbox, eventually, quota, TestServer, ALICE, EVE, OPERATOR, PATIENCE,
    SSH_KEY,
};

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

#[tokio::test]
async fn a_force_delete_on_a_silent_host_releases_everything_at_once_and_the_host_lets_it_go() {
    let t = server(|_| {}).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let id = running(&t, &pool, "forced").await;
    assert!(host.domains().contains_key(&id));
    host.set_reporting(false);
    // Another tenant cannot force it.
    let body = json!({ "tenantId": "globex", "instanceId": id, "force": true });
    assert_eq!(
        t.err(EVE, "instances.delete", body).await.body["code"],
        "NOT_FOUND"
    );
    let body = json!({ "tenantId": "acme", "instanceId": id, "force": true });
    let gone = t.ok(ALICE, "instances.delete", body.clone()).await;
    assert_eq!(
        gone["state"], "deleted",
        "at once, without the host: {gone}"
    );
    assert_eq!(held(&t, &pool).await, empty);
    let events = history(&t, &id).await;
    assert_eq!(
        find(&events, "instance.deleting")["data"]["reason"],
        "force"
    );
    // Again: nothing more happens.
    let again = t.ok(ALICE, "instances.delete", body).await;
    assert_eq!(again["version"], gone["version"]);
    // The host comes back still holding it: it is told to let it go.
    assert!(
        host.domains().contains_key(&id),
        "the silent host still holds it"
    );
    host.set_reporting(true);
    eventually("the host lets the instance go", PATIENCE, || async {
        if host.domains().contains_key(&id) {
            Err(host.last_orphans())
        } else {
            Ok(())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = t.ok(ALICE, "instances.get", acme_instance(&id)).await;
    assert_eq!(after["state"], "deleted");
    assert_eq!(
        after["version"], gone["version"],
        "the host's return changes nothing"
    );
    assert_eq!(held(&t, &pool).await, empty);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_force_delete_of_a_sandbox_on_a_silent_host_ends_it_at_once() {
    let t = server(|_| {}).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let tpl = t.sandbox_template(&pool, "t", json!({})).await;
    let s = t.ready_sandbox(&tpl["id"], "s", json!({})).await;
    let id = s["id"].as_str().unwrap();
    let instance = s["instanceId"].as_str().unwrap().to_string();
    host.set_reporting(false);
    let body = json!({ "tenantId": "globex", "sandboxId": id, "force": true });
    assert_eq!(
        t.err(EVE, "sandboxes.delete", body).await.body["code"],
        "NOT_FOUND"
    );
    let mut body = acme_sandbox(id);
    body["force"] = json!(true);
    let gone = t.ok(ALICE, "sandboxes.delete", body).await;
    assert_eq!(gone["state"], "deleted", "{gone}");
    let inst = t
        .ok(OPERATOR, "instances.get", acme_instance(&instance))
        .await;
    assert_eq!(inst["state"], "deleted", "{inst}");
    assert_eq!(held(&t, &pool).await, empty);
    host.set_reporting(true);
    eventually(
        "the host lets the sandbox's instance go",
        PATIENCE,
        || async {
            if host.domains().contains_key(&instance) {
                Err(())
            } else {
                Ok(())
            }
        },
    )
    .await;
    assert_eq!(
        t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await["state"],
        "deleted"
    );
    assert!(t.replay_equal().await);
}

/// Takes the instance `id` through `call` on a silent host, checks it waits there, then moves
/// the clock past the state's deadline: it fails with `reason: deadline:<state>` and is
/// released, leaving the pool as it held before it was made.
async fn stuck_until_deadline(
    t: &TestServer,
    pool: &str,
    host: &HostHandle,
    id: &str,
    call: (&str, Value),
    state: &str,
    empty: (usize, i64, i64),
) {
    host.set_reporting(false);
    let (method, body) = call;
    let moved = t.ok(ALICE, method, body).await;
    // Stopping is a running instance wanted stopped.
    let entered = match state {
        "stopping" => moved["desiredState"] == "stopped",
        _ => moved["state"] == state,
    };
    assert!(entered, "{moved}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let inst = t.ok(ALICE, "instances.get", acme_instance(id)).await;
    assert_ne!(
        inst["state"], "deleted",
        "nothing happens before the deadline: {inst}"
    );
    assert_ne!(
        inst["state"], "error",
        "nothing happens before the deadline: {inst}"
    );
    t.advance(Duration::from_secs(31));
    reaches(t, id, "deleted").await;
    let events = history(t, id).await;
    let reason = format!("deadline:{state}");
    assert_eq!(find(&events, "instance.failed")["data"]["reason"], reason);
    assert_eq!(find(&events, "instance.deleting")["data"]["reason"], reason);
    find(&events, "instance.deleted");
    assert_eq!(
        held(t, pool).await,
        empty,
        "everything the instance stuck {state} held is free"
    );
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn an_instance_stuck_starting_on_a_silent_host_fails_at_its_deadline_and_releases_everything()
{
    let t = server(|c| c.timings.deadline_instance_starting = 30.0).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let id = running(&t, &pool, "starting").await;
    // The host fails the guest; a start of the failed instance is `starting` until the host
    // says otherwise, and the host falls silent.
    host.fail_instance(&id, "the guest crashed");
    reaches(&t, &id, "error").await;
    let start = ("instances.start", acme_instance(&id));
    stuck_until_deadline(&t, &pool, &host, &id, start, "starting", empty).await;
}

#[tokio::test]
async fn an_instance_stuck_stopping_on_a_silent_host_fails_at_its_deadline_and_releases_everything()
{
    let t = server(|c| c.timings.deadline_instance_stopping = 30.0).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let id = running(&t, &pool, "stopping").await;
    let stop = ("instances.stop", acme_instance(&id));
    stuck_until_deadline(&t, &pool, &host, &id, stop, "stopping", empty).await;
}

#[tokio::test]
async fn a_sandbox_stuck_deleting_on_a_silent_host_is_deleted_at_its_deadline_and_releases_everything(
) {
    let t = server(|c| c.timings.deadline_sandbox_deleting = 30.0).await;
    let (pool, host) = pool_with_host(&t).await;
    let empty = held(&t, &pool).await;
    let tpl = t.sandbox_template(&pool, "t", json!({})).await;
    let s = t.ready_sandbox(&tpl["id"], "s", json!({})).await;
    let id = s["id"].as_str().unwrap();
    let instance = s["instanceId"].as_str().unwrap().to_string();
    host.set_reporting(false);
    let deleting = t.ok(ALICE, "sandboxes.delete", acme_sandbox(id)).await;
    assert_eq!(deleting["state"], "deleting", "{deleting}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await["state"],
        "deleting",
        "nothing happens before the deadline"
    );
    t.advance(Duration::from_secs(31));
    eventually("the stuck sandbox is deleted", PATIENCE, || async {
        let now = t.ok(ALICE, "sandboxes.get", acme_sandbox(id)).await;
        if now["state"] == "deleted" {
            Ok(())
        } else {
            Err(now["state"].clone())
        }
    })
    .await;
    let events = t
        .ok(OPERATOR, "instances.history", acme_instance(&instance))
        .await;
    let events = events["items"].as_array().unwrap();
    assert_eq!(
        find(events, "instance.deleting")["data"]["reason"],
        "deadline:deleting"
    );
    find(events, "instance.deleted");
    assert_eq!(
        held(&t, &pool).await,
        empty,
        "everything the sandbox held is free"
    );
    assert!(t.replay_equal().await);
}
