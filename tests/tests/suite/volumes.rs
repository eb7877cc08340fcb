//! Sandbox volumes over HTTP against a real server, its reconcilers and emulated hosts: ids
//! from keys, sizes, growth, one resize at a time, quota and node bookings, templates that
//! mount volumes, placement on the volume's node, one writer, deletion, the volume meter and
//! tenant teardown.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{
    acme_instance, acme_sandbox, eventually, merged, TestServer, ALICE, BOB, EVE, OPERATOR,
    PATIENCE, SSH_KEY,
};

const BOOT: Duration = Duration::from_millis(50);

async fn server() -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.usage_window = 1.0;
    })
    .await
}

/// A hosted pool offered to acme (disk quota `disk`) with `nodes` emulated hosts of 500 GiB.
async fn pool_with_hosts(t: &TestServer, nodes: usize, disk: u64) -> (String, Vec<HostHandle>) {
    let quota = json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": disk });
    t.pool_with_hosts("10.0.0.0/24", quota, nodes, BOOT).await
}

fn volume_body(pool: &str, name: &str, size: u64, key: &str) -> Value {
    json!({ "tenantId": "acme", "poolId": pool, "name": name, "sizeGiB": size,
            "idempotencyKey": key })
}

async fn create_volume(t: &TestServer, pool: &str, name: &str, size: u64) -> Value {
    t.ok(
        ALICE,
        "sandboxVolumes.create",
        volume_body(pool, name, size, name),
    )
    .await
}

async fn volume(t: &TestServer, id: &Value) -> Value {
    t.ok(
        ALICE,
        "sandboxVolumes.get",
        json!({ "tenantId": "acme", "volumeId": id }),
    )
    .await
}

async fn resize(t: &TestServer, id: &Value, size: u64) -> Result<Value, vps_tests::Answer> {
    t.call(
        ALICE,
        "sandboxVolumes.resize",
        json!({ "tenantId": "acme", "volumeId": id, "sizeGiB": size }),
    )
    .await
}

async fn delete_volume(t: &TestServer, id: &Value) -> Result<Value, vps_tests::Answer> {
    t.call(
        ALICE,
        "sandboxVolumes.delete",
        json!({ "tenantId": "acme", "volumeId": id }),
    )
    .await
}

fn refusal(answer: Result<Value, vps_tests::Answer>) -> Value {
    answer.expect_err("a refusal").body
}

/// acme's `diskGiB` usage in the pool.
async fn disk_used(t: &TestServer, pool: &str) -> u64 {
    let usage = t
        .ok(
            OPERATOR,
            "pools.usage",
            json!({ "poolId": pool, "tenantId": "acme" }),
        )
        .await;
    usage["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["resource"] == "diskGiB")
        .map_or(0, |i| i["used"].as_u64().unwrap())
}

/// The disk booked on a node.
async fn disk_booked(t: &TestServer, node: &Value) -> u64 {
    let n = t.ok(OPERATOR, "nodes.get", json!({ "nodeId": node })).await;
    n["allocated"]["diskGiB"].as_u64().unwrap()
}

async fn wait_state(t: &TestServer, id: &Value, state: &str) -> Value {
    eventually(&format!("volume {id} {state}"), PATIENCE, || async {
        let v = volume(t, id).await;
        if v["state"] == state {
            Ok(v)
        } else {
            Err(v["state"].clone())
        }
    })
    .await
}

async fn template(
    t: &TestServer,
    pool: &str,
    name: &str,
    extra: Value,
) -> Result<Value, vps_tests::Answer> {
    let body = json!({ "tenantId": "acme", "name": name, "poolId": pool,
                       "flavor": "small", "imageId": "img_ubuntu" });
    t.call(ALICE, "sandboxTemplates.create", merged(body, extra))
        .await
}

async fn sandbox(t: &TestServer, template: &Value, key: &str) -> Result<Value, vps_tests::Answer> {
    t.call(
        ALICE,
        "sandboxes.create",
        json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": key,
                "wait": { "timeoutMs": 20000 } }),
    )
    .await
}

async fn instance(t: &TestServer, id: &Value) -> Value {
    t.ok(OPERATOR, "instances.get", acme_instance(id)).await
}

#[tokio::test]
async fn a_volume_is_created_once_per_key_and_listed_for_its_owner() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1, 1000).await;
    let v = create_volume(&t, &pool, "memory", 50).await;
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("vol_") && id.len() == 4 + 52, "{id}");
    assert_eq!(v["state"], "ready");
    assert_eq!(v["sizeGiB"], 50);
    assert_eq!(v["name"], "memory");
    assert_eq!(v["poolId"], pool.as_str());
    assert_eq!(v["attachedTo"], json!([]));
    assert_eq!(
        v["serial"].as_str().unwrap(),
        format!("vps-{}", &id[id.len() - 16..])
    );
    assert_eq!(v["ownerIdentityId"], "id_alice");

    // The same key again: the same volume; the key with another request: CONFLICT.
    let again = create_volume(&t, &pool, "memory", 50).await;
    assert_eq!(again["id"], v["id"]);
    assert_eq!(again["version"], 1);
    let conflict = refusal(
        t.call(
            ALICE,
            "sandboxVolumes.create",
            volume_body(&pool, "memory", 60, "memory"),
        )
        .await,
    );
    assert_eq!(conflict["code"], "CONFLICT");
    assert_eq!(conflict["details"]["volumeId"], v["id"]);
    // Another key, the same name: CONFLICT.
    let taken = refusal(
        t.call(
            ALICE,
            "sandboxVolumes.create",
            volume_body(&pool, "memory", 5, "other"),
        )
        .await,
    );
    assert_eq!(taken["code"], "CONFLICT", "{taken}");
    for size in [0, 16_385] {
        let bad = refusal(
            t.call(
                ALICE,
                "sandboxVolumes.create",
                volume_body(&pool, "big", size, "big"),
            )
            .await,
        );
        assert_eq!(bad["code"], "INVALID_INPUT", "{size}: {bad}");
        assert_eq!(bad["details"]["field"], "sizeGiB");
    }
    // Volumes live on hosted pools only.
    let account = t
        .ok(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": "emulator", "name": "e", "config": {} }),
        )
        .await;
    let cloud = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "cloud", "class": "provider", "providerAccountId": account["id"] }),
        )
        .await;
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": cloud["id"], "tenantId": "acme", "quota": { "diskGiB": 100 } }),
    )
    .await;
    let provider = refusal(
        t.call(
            ALICE,
            "sandboxVolumes.create",
            volume_body(cloud["id"].as_str().unwrap(), "c", 5, "c"),
        )
        .await,
    );
    assert_eq!(provider["code"], "INVALID_INPUT", "{provider}");

    // Bob (same tenant) makes his own; `mine` lists one's own, `all` the tenant's.
    t.ok(
        BOB,
        "sandboxVolumes.create",
        volume_body(&pool, "bobs", 5, "b"),
    )
    .await;
    let mine = t
        .ok(BOB, "sandboxVolumes.list", json!({ "tenantId": "acme" }))
        .await;
    let names: Vec<&str> = mine["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["bobs"]);
    let all = t
        .ok(
            BOB,
            "sandboxVolumes.list",
            json!({ "tenantId": "acme", "scope": "all", "poolId": pool }),
        )
        .await;
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
    assert_eq!(all["items"][0]["name"], "memory", "oldest first");
    assert_eq!(
        t.ok(
            BOB,
            "sandboxVolumes.get",
            json!({ "tenantId": "acme", "volumeId": id })
        )
        .await["id"],
        v["id"]
    );
    let foreign = refusal(
        t.call(
            EVE,
            "sandboxVolumes.get",
            json!({ "tenantId": "globex", "volumeId": id }),
        )
        .await,
    );
    assert_eq!(foreign["code"], "NOT_FOUND");

    // Charged to quota and booked on its node.
    assert_eq!(disk_used(&t, &pool).await, 55);
    assert_eq!(disk_booked(&t, &v["nodeId"]).await, 55);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn volumes_only_grow_within_quota_and_their_nodes_room_one_resize_at_a_time() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1, 1000).await;
    let v = create_volume(&t, &pool, "memory", 10).await;
    let id = &v["id"];

    let shrink = refusal(resize(&t, id, 5).await);
    assert_eq!(shrink["code"], "INVALID_INPUT");
    assert_eq!(shrink["details"]["field"], "sizeGiB");
    let same = resize(&t, id, 10).await.unwrap();
    assert_eq!(same["version"], 1, "the same size changes nothing");
    let grown = resize(&t, id, 30).await.unwrap();
    assert_eq!(grown["sizeGiB"], 30);
    assert_eq!(disk_used(&t, &pool).await, 30);
    assert_eq!(disk_booked(&t, &v["nodeId"]).await, 30);

    // Past the quota (1000), then past the node (500): refused, nothing changed.
    assert_eq!(
        refusal(resize(&t, id, 1001).await)["code"],
        "QUOTA_EXCEEDED"
    );
    let full = refusal(resize(&t, id, 501).await);
    assert_eq!(full["code"], "CAPACITY_UNAVAILABLE", "{full}");
    assert_eq!(volume(&t, id).await["sizeGiB"], 30);
    assert_eq!(disk_used(&t, &pool).await, 30);
    assert_eq!(disk_booked(&t, &v["nodeId"]).await, 30);

    // One resize in flight: while one holds the volume, another is refused.
    let mut held = t.server.state.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1 || $2, 0))")
        .bind(vps_commands::volumes::RESIZE_HOLD)
        .bind(id.as_str().unwrap())
        .execute(&mut *held)
        .await
        .unwrap();
    let busy = refusal(resize(&t, id, 40).await);
    assert_eq!(busy["code"], "CONFLICT");
    assert_eq!(busy["details"]["reason"], "resize-in-flight");
    held.rollback().await.unwrap();
    assert_eq!(resize(&t, id, 40).await.unwrap()["sizeGiB"], 40);

    // Concurrent resizes: whatever order they run in, no update is lost.
    let (a, b) = tokio::join!(resize(&t, id, 60), resize(&t, id, 50));
    let applied: Vec<u64> = [&a, &b]
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|v| v["sizeGiB"].as_u64().unwrap())
        .collect();
    assert!(!applied.is_empty(), "{a:?} {b:?}");
    for r in [&a, &b] {
        if let Err(e) = r {
            let reason = &e.body["details"]["reason"];
            assert!(
                reason == "resize-in-flight" || e.body["details"]["field"] == "sizeGiB",
                "{}",
                e.body
            );
        }
    }
    let now = volume(&t, id).await["sizeGiB"].as_u64().unwrap();
    assert!(applied.contains(&now), "{applied:?} {now}");
    assert_eq!(disk_used(&t, &pool).await, now);
    assert_eq!(disk_booked(&t, &v["nodeId"]).await, now);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn sandboxes_attach_their_templates_volume_on_its_node_with_one_writer() {
    let t = server().await;
    let (pool, hosts) = pool_with_hosts(&t, 2, 2000).await;
    // An instance books disk and vCPU on one node: a volume then goes to the other (more free
    // disk), while an unconstrained instance would go to the busier one (best vCPU fit).
    let busy = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
                    "sshKeys": [SSH_KEY], "idempotencyKey": "busy" }),
        )
        .await;
    let v = create_volume(&t, &pool, "memory", 40).await;
    assert_ne!(v["nodeId"], busy["nodeId"]);
    let id = &v["id"];

    let mounts = |path: &str| json!({ "volumes": [{ "name": "memory", "mountPath": path }] });
    let warm = json!({ "volumes": [{ "name": "memory", "mountPath": "/workspace" }],
                       "warm": { "min": 0, "max": 1 } });
    let refused = refusal(template(&t, &pool, "w", warm).await);
    assert_eq!(refused["code"], "INVALID_INPUT");
    assert_eq!(refused["details"]["field"], "warm");
    for path in ["/etc", "/proc/x", "workspace", "/a/../b"] {
        let bad = refusal(template(&t, &pool, "p", mounts(path)).await);
        assert_eq!(bad["code"], "INVALID_INPUT", "{path}: {bad}");
    }
    let unknown = json!({ "volumes": [{ "name": "nope", "mountPath": "/w" }] });
    assert_eq!(
        refusal(template(&t, &pool, "u", unknown).await)["code"],
        "NOT_FOUND"
    );
    let tpl = template(&t, &pool, "agent", mounts("/workspace"))
        .await
        .unwrap();
    assert_eq!(tpl["volumes"][0]["volumeId"], *id);
    assert_eq!(tpl["volumes"][0]["readOnly"], false);

    let first = sandbox(&t, &tpl["id"], "one").await.unwrap();
    assert_eq!(first["state"], "ready", "{first}");
    let inst = instance(&t, &first["instanceId"]).await;
    assert_eq!(inst["nodeId"], v["nodeId"], "placed on the volume's node");
    assert_eq!(
        volume(&t, id).await["attachedTo"],
        json!([first["instanceId"]])
    );

    // The NodeSpec lists the volume, and the instance's attachment.
    t.specs_caught_up().await;
    let spec = t
        .ok(OPERATOR, "nodes.spec", json!({ "nodeId": v["nodeId"] }))
        .await;
    assert_eq!(
        spec["volumes"],
        json!([{ "id": id, "sizeGiB": 40, "serial": v["serial"] }])
    );
    let entry = spec["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == first["instanceId"])
        .unwrap();
    assert_eq!(
        entry["volumes"],
        json!([{ "volumeId": id, "serial": v["serial"], "mountPath": "/workspace", "readOnly": false }])
    );
    eventually("the host keeps the volume", PATIENCE, || async {
        let kept = hosts
            .iter()
            .any(|h| h.volumes().iter().any(|x| x.id == id.as_str().unwrap()));
        kept.then_some(()).ok_or("not yet")
    })
    .await;

    // One writer: a second sandbox that would write it is refused.
    let second = refusal(sandbox(&t, &tpl["id"], "two").await);
    assert_eq!(second["code"], "CONFLICT");
    assert_eq!(second["details"]["reason"], "volume-in-use");
    // Readers neither, while the writer lives.
    let ro = json!({ "volumes": [{ "name": "memory", "mountPath": "/data", "readOnly": true }] });
    let reader = template(&t, &pool, "reader", ro).await.unwrap();
    let refused = refusal(sandbox(&t, &reader["id"], "r").await);
    assert_eq!(refused["details"]["reason"], "volume-in-use");

    // Delete: refused while attached, then while templates name it.
    let attached = refusal(delete_volume(&t, id).await);
    assert_eq!(attached["code"], "CONFLICT");
    assert_eq!(attached["details"]["reason"], "volume-attached");
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&first["id"]))
        .await;
    t.until(
        OPERATOR,
        "acme",
        first["instanceId"].as_str().unwrap(),
        PATIENCE,
        |i| i["state"] == "deleted",
    )
    .await;
    // The writer is gone: two readers may share it.
    let r1 = sandbox(&t, &reader["id"], "r1").await.unwrap();
    let r2 = sandbox(&t, &reader["id"], "r2").await.unwrap();
    assert_eq!(instance(&t, &r2["instanceId"]).await["nodeId"], v["nodeId"]);
    assert_eq!(
        refusal(sandbox(&t, &tpl["id"], "three").await)["details"]["reason"],
        "volume-in-use"
    );
    for s in [&r1, &r2] {
        t.ok(ALICE, "sandboxes.delete", acme_sandbox(&s["id"]))
            .await;
        t.until(
            OPERATOR,
            "acme",
            s["instanceId"].as_str().unwrap(),
            PATIENCE,
            |i| i["state"] == "deleted",
        )
        .await;
    }
    let named = refusal(delete_volume(&t, id).await);
    assert_eq!(named["details"]["reason"], "volume-in-template");
    for tpl in [&tpl, &reader] {
        t.ok(
            ALICE,
            "sandboxTemplates.delete",
            json!({ "tenantId": "acme", "templateId": tpl["id"] }),
        )
        .await;
    }
    let deleting = delete_volume(&t, id).await.unwrap();
    assert!(
        deleting["state"] == "deleting" || deleting["state"] == "deleted",
        "{deleting}"
    );
    let deleted = wait_state(&t, id, "deleted").await;
    assert!(deleted["deletedAt"].is_string());
    assert_eq!(disk_booked(&t, &v["nodeId"]).await, 0);
    assert_eq!(
        disk_used(&t, &pool).await,
        20,
        "only the busy instance's disk"
    );
    assert!(
        hosts.iter().all(|h| h.volumes().is_empty()),
        "no host keeps it"
    );
    // Deleted volumes free their name and hide from lists unless asked for.
    let listed = t
        .ok(ALICE, "sandboxVolumes.list", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(listed["items"], json!([]));
    let with_deleted = t
        .ok(
            ALICE,
            "sandboxVolumes.list",
            json!({ "tenantId": "acme", "includeDeleted": true }),
        )
        .await;
    assert_eq!(with_deleted["items"][0]["state"], "deleted");
    t.ok(
        ALICE,
        "sandboxVolumes.create",
        volume_body(&pool, "memory", 1, "reused-name"),
    )
    .await;

    // The volume's events are in the log, on its own subject.
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.volume.*"], "subject": format!("volume/{}", id.as_str().unwrap()) }),
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
            "sandbox.volume.created",
            "sandbox.volume.deleting",
            "sandbox.volume.deleted"
        ]
    );
    assert_eq!(events["items"][0]["data"]["sizeGiB"], 40);
    assert!(t.replay_equal().await);
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str().unwrap().parse().unwrap()
}

#[tokio::test]
async fn the_volume_meter_bills_its_size_from_booking_to_release() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1, 1000).await;
    let v = create_volume(&t, &pool, "memory", 10).await;
    let id = &v["id"];
    // No sleep: the amounts are checked exactly against the recorded times, however short.
    resize(&t, id, 25).await.unwrap();
    delete_volume(&t, id).await.unwrap();
    wait_state(&t, id, "deleted").await;
    t.settle().await;
    let history = t
        .ok(
            ALICE,
            "events.list",
            json!({ "subject": format!("volume/{}", id.as_str().unwrap()) }),
        )
        .await;
    let at = |ty: &str| {
        history["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["type"] == ty)
            .map(|e| time(&e["time"]))
            .unwrap()
    };
    let (created, resized, deleted) = (
        at("sandbox.volume.created"),
        at("sandbox.volume.resized"),
        at("sandbox.volume.deleted"),
    );
    let records = eventually("the volume's windows recorded", PATIENCE, || async {
        let page = t
            .ok(
                ALICE,
                "usage.list",
                json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                        "to": "2100-01-01T00:00:00Z", "resourceId": id,
                        "meter": "vps.volume.gib.hours", "limit": 1000 }),
            )
            .await;
        let items = page["items"].as_array().unwrap().clone();
        match items.last() {
            Some(last) if time(&last["windowEnd"]) == deleted => Ok(items),
            _ => Err(items.len()),
        }
    })
    .await;
    assert_eq!(time(&records[0]["windowStart"]), created);
    for pair in records.windows(2) {
        assert_eq!(pair[0]["windowEnd"], pair[1]["windowStart"], "contiguous");
    }
    assert!(records.iter().all(|r| r["unit"] == "gib-hour"
        && r["tenantId"] == "acme"
        && r["identityId"] == "id_alice"
        && r["poolId"] == pool.as_str()));
    let micros = |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_microseconds().unwrap();
    let gib_micros = 10 * micros(created, resized) + 25 * micros(resized, deleted);
    let exact = (Decimal::from(gib_micros) / Decimal::from(3_600_000_000i64)).round_dp(12);
    let sum: Decimal = records
        .iter()
        .map(|r| Decimal::from_str(r["quantity"].as_str().unwrap()).unwrap())
        .sum();
    assert_eq!(sum, exact);
    let windows = vps_api::server::usage_windows(&t.server.state.config);
    let report = vps_reactors::usage::verify::verify(
        &t.server.state.pool,
        windows,
        DateTime::<Utc>::MIN_UTC,
        vps_clock::Clock::system().now() + chrono::Duration::days(1),
    )
    .await
    .unwrap();
    assert_eq!(report.first_difference, None);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn tenant_teardown_deletes_its_volumes_after_its_instances() {
    let t = server().await;
    let (pool, _hosts) = pool_with_hosts(&t, 1, 1000).await;
    let v = create_volume(&t, &pool, "memory", 10).await;
    let tpl = template(
        &t,
        &pool,
        "agent",
        json!({ "volumes": [{ "name": "memory", "mountPath": "/workspace" }] }),
    )
    .await
    .unwrap();
    let s = sandbox(&t, &tpl["id"], "one").await.unwrap();
    assert_eq!(s["state"], "ready");
    t.ok(OPERATOR, "tenants.delete", json!({ "tenantId": "acme" }))
        .await;
    let refused = refusal(
        t.call(
            ALICE,
            "sandboxVolumes.create",
            volume_body(&pool, "late", 1, "late"),
        )
        .await,
    );
    assert_eq!(refused["code"], "INVALID_STATE");
    t.teardown_done("acme").await;
    assert_eq!(volume(&t, &v["id"]).await["state"], "deleted");
    assert_eq!(disk_used(&t, &pool).await, 0);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn concurrent_volumes_never_book_a_node_past_its_disk() {
    let t = server().await;
    // One node of 500 GiB; the quota leaves the node's room the only limit.
    let (pool, _hosts) = pool_with_hosts(&t, 1, 10_000).await;
    let creates = (0..10).map(|i| {
        let (t, pool) = (&t, &pool);
        async move {
            let name = format!("v{i}");
            let body = volume_body(pool, &name, 100, &name);
            t.call(ALICE, "sandboxVolumes.create", body).await
        }
    });
    let answers = futures::future::join_all(creates).await;
    let created: Vec<&Value> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    let refused: Vec<&Value> = answers
        .iter()
        .filter_map(|a| a.as_ref().err().map(|e| &e.body))
        .collect();
    assert_eq!(created.len(), 5, "five of 100 GiB fit 500 GiB: {refused:?}");
    for r in &refused {
        assert_eq!(r["code"], "CAPACITY_UNAVAILABLE", "{r}");
    }
    assert_eq!(disk_booked(&t, &created[0]["nodeId"]).await, 500);
    assert_eq!(disk_used(&t, &pool).await, 500);
}
