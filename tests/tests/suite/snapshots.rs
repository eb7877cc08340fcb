//! Snapshots and restores over HTTP against a real server, its reconciler and emulated hosts
//! that really upload to and download from the `file` store: ready, restore on a node of the
//! same CPU model, refusals, failed uploads, timeouts, kept and purged objects, replay.

use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{
    acme_instance, acme_sandbox, eventually, merged, quota, wait_until, TestServer, ALICE, BOB,
    EVE, OPERATOR, PATIENCE,
};

const BOOT: Duration = Duration::from_millis(50);

/// A server whose snapshots time out after a minute, so a snapshot that should be ready never
/// fails for a slow moment of a loaded machine (at one second, 12 of 30 of these tests failed
/// with three test runs at once).
async fn server() -> TestServer {
    server_failing_snapshots_after(60.0).await
}

/// A server whose reconciler fails a snapshot still pending after `seconds`.
async fn server_failing_snapshots_after(seconds: f64) -> TestServer {
    TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.snapshot_timeout = seconds;
    })
    .await
}

/// A node of `cpu` in `pool` with its emulated host.
async fn node(
    t: &TestServer,
    pool: &str,
    name: &str,
    cpu: &str,
    extra: Value,
) -> (String, HostHandle) {
    let body = json!({ "poolId": pool, "name": name, "cpuModel": cpu,
                       "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 } });
    let answer = t.ok(OPERATOR, "nodes.register", merged(body, extra)).await;
    let id = answer["node"]["id"].as_str().unwrap().to_string();
    let token = answer["nodeToken"].as_str().unwrap();
    let mut config = vps_emulators::host::HostConfig::new(t.server.url(), id.clone(), token);
    config.boot_delay = BOOT;
    config.report_interval = Duration::from_millis(200);
    config.poll_wait = Duration::from_millis(1000);
    config.snapshot_bytes = 256 * 1024;
    config.cpu_model = Some(cpu.to_string());
    config.tunnel_listen = Some("127.0.0.1:0".into());
    (id, vps_emulators::host::EmulatedHost::start(config))
}

/// A pool with one `epyc` node and its host, and a template `py` in it.
async fn one_node(t: &TestServer, cidr: &str) -> (String, HostHandle, String) {
    let pool = t.hosted_pool(cidr, 0, quota(100)).await;
    let (_, host) = node(t, &pool, "n", "epyc", json!({})).await;
    let tpl = template(t, &pool, "py").await;
    (pool, host, tpl)
}

/// Alice's template `name` in `pool`: its id.
async fn template(t: &TestServer, pool: &str, name: &str) -> String {
    t.sandbox_template(pool, name, json!({})).await["id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn create(t: &TestServer, token: &str, body: Value) -> Result<Value, vps_tests::Answer> {
    let full = json!({ "tenantId": "acme", "wait": { "timeoutMs": 20000 } });
    t.call(token, "sandboxes.create", merged(full, body)).await
}

/// Alice's restore of `snapshot` under `template`, made with `key`: the sandbox as the create
/// answers it (after waiting up to 20 s for `ready`).
async fn restore_of(t: &TestServer, template: &str, key: &str, snapshot: &str) -> Value {
    create(
        t,
        ALICE,
        json!({ "templateId": template, "idempotencyKey": key, "fromSnapshot": snapshot }),
    )
    .await
    .expect("a restore")
}

async fn sandbox(t: &TestServer, template: &str, key: &str) -> Value {
    let s = create(
        t,
        ALICE,
        json!({ "templateId": template, "idempotencyKey": key }),
    )
    .await
    .expect("a sandbox");
    assert_eq!(s["state"], "ready", "{s}");
    s
}

async fn snapshot(
    t: &TestServer,
    token: &str,
    sandbox: &str,
    extra: Value,
) -> Result<Value, vps_tests::Answer> {
    t.call(
        token,
        "sandboxes.snapshot",
        merged(acme_sandbox(sandbox), extra),
    )
    .await
}

/// Alice's snapshot of `sandbox` with the fields of `extra`, which must be taken: the snapshot.
async fn take(t: &TestServer, sandbox: &str, extra: Value) -> Value {
    snapshot(t, ALICE, sandbox, extra).await.unwrap()
}

/// Alice's snapshot of `sandbox` with the fields of `extra`, which must be refused: the
/// refusal's code and details.
async fn refused(t: &TestServer, sandbox: &str, extra: Value) -> (String, Value) {
    refusal(snapshot(t, ALICE, sandbox, extra).await)
}

/// The body that names acme's snapshot `id`.
fn acme_snapshot(id: impl serde::Serialize) -> Value {
    json!({ "tenantId": "acme", "snapshotId": id })
}

/// Waits until the snapshot leaves `pending`; its view then.
async fn settled(t: &TestServer, id: &str) -> Value {
    eventually("the snapshot settles", PATIENCE, || async {
        let s = t.ok(ALICE, "sandboxSnapshots.get", acme_snapshot(id)).await;
        if s["state"] != "pending" {
            Ok(s)
        } else {
            Err(s)
        }
    })
    .await
}

fn object(t: &TestServer, id: &str) -> std::path::PathBuf {
    t.snapshots.path().join("acme").join(id)
}

fn refusal(answer: Result<Value, vps_tests::Answer>) -> (String, Value) {
    let err = answer.expect_err("a refusal");
    (
        err.body["code"].as_str().unwrap().to_string(),
        err.body["details"].clone(),
    )
}

async fn instance(t: &TestServer, id: &str) -> Value {
    t.ok(OPERATOR, "instances.get", acme_instance(id)).await
}

async fn cordon(t: &TestServer, node: &str) {
    t.ok(OPERATOR, "nodes.cordon", json!({ "nodeId": node }))
        .await;
}

#[tokio::test]
async fn a_memory_snapshot_restores_on_another_node_of_its_cpu_model_only() {
    let t = server().await;
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota(100)).await;
    let (a, host_a) = node(&t, &pool, "a", "epyc-9654", json!({})).await;
    let (_b, host_b) = node(&t, &pool, "b", "epyc-9654", json!({})).await;
    let (c, _host_c) = node(&t, &pool, "c", "xeon-8480", json!({})).await;
    // The source lands on a: the others are cordoned until it runs.
    cordon(&t, &_b).await;
    cordon(&t, &c).await;
    let tpl = template(&t, &pool, "py").await;
    let source = sandbox(&t, &tpl, "src").await;
    let sbx = source["id"].as_str().unwrap();
    assert_eq!(
        instance(&t, source["instanceId"].as_str().unwrap()).await["nodeId"],
        a
    );

    let snap = take(&t, sbx, json!({})).await;
    assert_eq!(snap["state"], "pending");
    assert_eq!(
        (snap["includeMemory"].clone(), snap["keep"].clone()),
        (json!(true), json!(false))
    );
    let id = snap["id"].as_str().unwrap().to_string();
    let ready = settled(&t, &id).await;
    assert_eq!(ready["state"], "ready", "{ready}");
    assert_eq!(ready["sizeBytes"], 256 * 1024);
    assert_eq!(ready["cpuModel"], "epyc-9654");
    assert_eq!(ready["runtime"], "libvirt-kvm");
    // The host really uploaded it: the stored object has the reported digest.
    let stored = std::fs::read(object(&t, &id)).expect("the stored object");
    assert_eq!(
        data_encoding::HEXLOWER.encode(&<sha2::Sha256 as sha2::Digest>::digest(&stored)),
        ready["sha256"].as_str().unwrap()
    );
    // Reads never show where the object is.
    let got = t.ok(ALICE, "sandboxes.get", acme_sandbox(sbx)).await;
    assert_eq!(got["snapshots"][0]["id"], id.as_str());
    for view in [got.to_string(), ready.to_string()] {
        assert!(
            !view.contains("/snapshots/") && !view.contains("sig="),
            "{view}"
        );
    }

    // a leaves: the restore goes to b, of the same CPU model, and boots the checked object.
    t.ok(OPERATOR, "nodes.uncordon", json!({ "nodeId": _b }))
        .await;
    cordon(&t, &a).await;
    let restored = restore_of(&t, &tpl, "restore-1", &id).await;
    assert_eq!(restored["state"], "ready", "{restored}");
    assert_eq!(
        (restored["warm"].clone(), restored["fromSnapshot"].clone()),
        (json!(false), json!(id))
    );
    let inst = restored["instanceId"].as_str().unwrap();
    assert_eq!(instance(&t, inst).await["nodeId"], _b);
    assert_eq!(
        host_b.domain(inst).unwrap().restored_from.as_deref(),
        Some(id.as_str())
    );

    // With only the other CPU model left, a memory restore waits Unschedulable.
    cordon(&t, &_b).await;
    t.ok(OPERATOR, "nodes.uncordon", json!({ "nodeId": c }))
        .await;
    let waiting = create(&t, ALICE, json!({ "templateId": tpl, "idempotencyKey": "restore-2", "fromSnapshot": id, "wait": { "timeoutMs": 500 } }))
        .await
        .unwrap();
    assert_eq!(waiting["state"], "starting");
    let inst = instance(&t, waiting["instanceId"].as_str().unwrap()).await;
    assert_eq!(inst["nodeId"], Value::Null, "{inst}");
    let conditions = inst["conditions"].to_string();
    assert!(conditions.contains("cpu.model"), "{conditions}");
    // A disk-only snapshot has no CPU model to match: its restore runs on c.
    t.ok(OPERATOR, "nodes.uncordon", json!({ "nodeId": a }))
        .await;
    let disk = take(&t, sbx, json!({ "includeMemory": false })).await;
    let disk_id = disk["id"].as_str().unwrap().to_string();
    assert_eq!(settled(&t, &disk_id).await["cpuModel"], Value::Null);
    cordon(&t, &a).await;
    let on_c = restore_of(&t, &tpl, "restore-3", &disk_id).await;
    assert_eq!(on_c["state"], "ready", "{on_c}");
    assert_eq!(
        instance(&t, on_c["instanceId"].as_str().unwrap()).await["nodeId"],
        c
    );

    // The events are in the log, on the sandbox's subject.
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.snapshot.*"], "subject": format!("sandbox/{sbx}") }),
        )
        .await;
    let types: Vec<&str> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert!(types.contains(&"sandbox.snapshot.ready"), "{types:?}");
    drop(host_a);
    assert!(
        t.replay_equal().await,
        "projections rebuilt from the log equal the live ones"
    );
}

/// A restore, like a warm claim, writes its instance's spec entry in the create's own
/// transaction: its host starts it without waiting for the NodeSpec follower, whose later pass
/// finds the entry as it wants it and leaves it.
#[tokio::test]
async fn a_restore_writes_its_spec_entry_in_the_creates_own_transaction() {
    let t = server().await;
    let (_pool, _host, tpl) = one_node(&t, "10.0.9.0/24").await;
    let source = sandbox(&t, &tpl, "src").await;
    let snap = take(&t, source["id"].as_str().unwrap(), json!({})).await;
    let id = snap["id"].as_str().unwrap();
    assert_eq!(settled(&t, id).await["state"], "ready");

    let restored = create(
        &t,
        ALICE,
        json!({ "templateId": tpl, "idempotencyKey": "inline", "fromSnapshot": id,
                "wait": { "timeoutMs": 0 } }),
    )
    .await
    .unwrap();
    let stream = format!("sandbox-{}", restored["id"].as_str().unwrap());
    let entry = vps_tests::spec_entry_written_with(
        &t.server.state.pool,
        restored["instanceId"].as_str().unwrap(),
        &stream,
    )
    .await;
    assert_eq!(
        entry,
        Some(("running".to_string(), true)),
        "the entry exists as the create answers, written by its transaction"
    );
    let restored = eventually("the restore ready", PATIENCE, || async {
        let s = t
            .ok(
                ALICE,
                "sandboxes.get",
                acme_sandbox(restored["id"].as_str().unwrap()),
            )
            .await;
        if s["state"] == "ready" {
            Ok(s)
        } else {
            Err(s)
        }
    })
    .await;
    assert_eq!(restored["fromSnapshot"], id);
}

#[tokio::test]
async fn refusals_come_before_anything_reaches_a_host() {
    let t = server().await;
    let pool = t
        .hosted_pool(
            "10.0.1.0/24",
            0,
            json!({ "vcpu": 100, "memoryGiB": 1000, "diskGiB": 10000, "gpu": 8 }),
        )
        .await;
    let (_n, host) = node(&t, &pool, "n", "epyc", json!({ "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500, "gpus": [{ "model": "h100", "count": 2 }] } })).await;
    let tpl = template(&t, &pool, "py").await;
    let s = sandbox(&t, &tpl, "one").await;
    let sbx = s["id"].as_str().unwrap();

    // Idempotency: the key derives the id; the same request answers it, another conflicts.
    let first = take(&t, sbx, json!({ "idempotencyKey": "nightly" })).await;
    let again = take(&t, sbx, json!({ "idempotencyKey": "nightly" })).await;
    assert_eq!(first["id"], again["id"]);
    let (code, details) = refused(
        &t,
        sbx,
        json!({ "idempotencyKey": "nightly", "keep": true }),
    )
    .await;
    assert_eq!(
        (code.as_str(), details["snapshotId"].clone()),
        ("CONFLICT", first["id"].clone())
    );
    let other = sandbox(&t, &tpl, "two").await;
    let (code, _) = refused(
        &t,
        other["id"].as_str().unwrap(),
        json!({ "idempotencyKey": "nightly" }),
    )
    .await;
    assert_eq!(code, "CONFLICT");
    // Another tenant does not see the sandbox; bad input is named.
    let (code, _) = refusal(
        t.call(
            EVE,
            "sandboxes.snapshot",
            json!({ "tenantId": "globex", "sandboxId": sbx }),
        )
        .await,
    );
    assert_eq!(code, "NOT_FOUND");
    let (code, _) = refused(&t, sbx, json!({ "idempotencyKey": "" })).await;
    assert_eq!(code, "INVALID_INPUT");
    let (code, _) = refused(&t, sbx, json!({ "includeMemory": "yes" })).await;
    assert_eq!(code, "INVALID_INPUT");

    // Passthrough GPUs: no memory snapshot, a disk-only one is fine.
    t.ok(OPERATOR, "flavors.create", json!({ "poolId": pool, "name": "gpu", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20, "gpus": { "model": "h100", "count": 1 } })).await;
    let gpu_tpl = t.ok(ALICE, "sandboxTemplates.create", json!({ "tenantId": "acme", "name": "gpu", "poolId": pool, "flavor": "gpu", "imageId": "img_ubuntu" })).await;
    let g = sandbox(&t, gpu_tpl["id"].as_str().unwrap(), "gpu").await;
    let gid = g["id"].as_str().unwrap();
    let (code, details) = refused(&t, gid, json!({})).await;
    assert_eq!(
        (code.as_str(), details["reason"].as_str()),
        ("INVALID_STATE", Some("memory-snapshot-with-gpus"))
    );
    take(&t, gid, json!({ "includeMemory": false })).await;

    // A deleting sandbox, and one whose instance does not run on a node.
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&other["id"]))
        .await;
    let (code, _) = refused(&t, other["id"].as_str().unwrap(), json!({})).await;
    assert_eq!(code, "INVALID_STATE");
    host.refuse_new(Some("full".into()));
    let stuck = create(
        &t,
        ALICE,
        json!({ "templateId": tpl, "idempotencyKey": "stuck", "wait": { "timeoutMs": 300 } }),
    )
    .await
    .unwrap();
    let (code, _) = refused(&t, stuck["id"].as_str().unwrap(), json!({})).await;
    assert_eq!(code, "INVALID_STATE");
    host.refuse_new(None);

    // A runtime without snapshots.
    let plain = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "containers", "class": "vps-host", "runtime": "containerd" }),
        )
        .await;
    let plain = plain["id"].as_str().unwrap();
    t.ok(
        OPERATOR,
        "pools.setIpPool",
        json!({ "poolId": plain, "cidr": "10.0.2.0/24" }),
    )
    .await;
    t.ok(OPERATOR, "pools.offer", json!({ "poolId": plain, "tenantId": "acme", "quota": { "vcpu": 10, "memoryGiB": 100, "diskGiB": 1000 } })).await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": plain, "name": "small", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 }),
    )
    .await;
    let (_c, _host_c) = node(
        &t,
        plain,
        "c",
        "epyc",
        json!({ "runtimes": ["containerd"] }),
    )
    .await;
    let c_tpl = template(&t, plain, "ctr").await;
    let cs = sandbox(&t, &c_tpl, "ctr").await;
    let (code, _) = refused(&t, cs["id"].as_str().unwrap(), json!({})).await;
    assert_eq!(code, "UNSUPPORTED");
}

#[tokio::test]
async fn restores_are_the_owners_own_ready_snapshots_under_their_template() {
    // Short enough to wait for the timeout below, long enough for the ready snapshot.
    let t = server_failing_snapshots_after(5.0).await;
    let (pool, host, tpl) = one_node(&t, "10.0.3.0/24").await;
    let other_tpl = template(&t, &pool, "other").await;
    let s = sandbox(&t, &tpl, "src").await;
    let sbx = s["id"].as_str().unwrap();
    let snap = take(&t, sbx, json!({ "keep": true })).await;
    let id = snap["id"].as_str().unwrap().to_string();
    assert_eq!(settled(&t, &id).await["state"], "ready");

    let restore = |token: &'static str, template: String, key: &'static str, from: String| {
        let t = &t;
        async move {
            create(
                t,
                token,
                json!({ "templateId": template, "idempotencyKey": key, "fromSnapshot": from }),
            )
            .await
        }
    };
    // Another identity of the tenant, another tenant, an unknown id: as if it did not exist.
    let (code, _) = refusal(restore(BOB, tpl.clone(), "bob", id.clone()).await);
    assert_eq!(code, "NOT_FOUND");
    let (code, _) = refusal(t.call(EVE, "sandboxes.create", json!({ "tenantId": "globex", "templateId": tpl, "idempotencyKey": "eve", "fromSnapshot": id })).await);
    assert_eq!(code, "NOT_FOUND");
    let (code, _) = refusal(
        restore(
            ALICE,
            tpl.clone(),
            "unknown",
            "snap_01jzzzzzzzzzzzzzzzzzzzzzzz".into(),
        )
        .await,
    );
    assert_eq!(code, "NOT_FOUND");
    // Only under its own template.
    let (code, _) = refusal(restore(ALICE, other_tpl.clone(), "other", id.clone()).await);
    assert_eq!(code, "INVALID_INPUT");
    // Pending and failed snapshots are not restorable.
    host.hold_commands(true);
    let pending = take(&t, sbx, json!({})).await;
    let pending = pending["id"].as_str().unwrap().to_string();
    let (code, _) = refusal(restore(ALICE, tpl.clone(), "pending", pending.clone()).await);
    assert_eq!(code, "INVALID_STATE");
    // It never settles: the reconciler fails it after snapshot_timeout.
    let timed_out = settled(&t, &pending).await;
    assert_eq!(
        (timed_out["state"].as_str(), timed_out["reason"].as_str()),
        (Some("failed"), Some("timeout"))
    );
    let (code, _) = refusal(restore(ALICE, tpl.clone(), "failed", pending.clone()).await);
    assert_eq!(code, "INVALID_STATE");
    host.hold_commands(false);

    // A kept snapshot outlives its sandbox and still restores; a deleted one does not.
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(sbx)).await;
    let ok = restore(ALICE, tpl.clone(), "after", id.clone())
        .await
        .unwrap();
    assert_eq!(ok["state"], "ready", "{ok}");
    t.ok(ALICE, "sandboxSnapshots.delete", acme_snapshot(&id))
        .await;
    let (code, _) = refusal(restore(ALICE, tpl.clone(), "deleted", id.clone()).await);
    assert_eq!(code, "NOT_FOUND");
    let (code, _) = refusal(
        t.call(ALICE, "sandboxSnapshots.get", acme_snapshot(&id))
            .await,
    );
    assert_eq!(code, "NOT_FOUND");
}

#[tokio::test]
async fn objects_are_purged_once_deleted_and_no_restore_needs_them() {
    let t = server().await;
    let (_, host, tpl) = one_node(&t, "10.0.4.0/24").await;
    let s = sandbox(&t, &tpl, "src").await;
    let sbx = s["id"].as_str().unwrap();
    // One snapshot of a sandbox is in flight at a time: each settles before the next.
    let kept = take(&t, sbx, json!({ "keep": true })).await;
    settled(&t, kept["id"].as_str().unwrap()).await;
    let unkept = take(&t, sbx, json!({ "includeMemory": false })).await;
    let (kept, unkept) = (
        kept["id"].as_str().unwrap().to_string(),
        unkept["id"].as_str().unwrap().to_string(),
    );
    settled(&t, &unkept).await;
    assert!(object(&t, &kept).exists() && object(&t, &unkept).exists());

    // A restore of the kept one is live; the sandbox goes.
    let restored = restore_of(&t, &tpl, "r", &kept).await;
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(sbx)).await;
    // The snapshot not kept goes with its sandbox, object and all.
    wait_until("the unkept object purged", PATIENCE, || async {
        !object(&t, &unkept).exists()
    })
    .await;
    let (code, _) = refusal(
        t.call(ALICE, "sandboxSnapshots.get", acme_snapshot(&unkept))
            .await,
    );
    assert_eq!(code, "NOT_FOUND");
    let listed = t
        .ok(
            ALICE,
            "sandboxSnapshots.list",
            json!({ "tenantId": "acme" }),
        )
        .await;
    let ids: Vec<&str> = listed["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![kept.as_str()]);

    // Deleting the kept one hides it at once, but its object stays while the restore lives.
    t.ok(ALICE, "sandboxSnapshots.delete", acme_snapshot(&kept))
        .await;
    t.quiet().await;
    assert!(
        object(&t, &kept).exists(),
        "a live restore still needs the object"
    );
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&restored["id"]))
        .await;
    wait_until("the kept object purged", PATIENCE, || async {
        !object(&t, &kept).exists()
    })
    .await;
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.snapshot.deleted"] }),
        )
        .await;
    assert_eq!(events["items"].as_array().unwrap().len(), 2);
    drop(host);
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_refused_upload_fails_the_snapshot_and_a_tampered_object_fails_its_restore() {
    let t = server().await;
    let (_, host, tpl) = one_node(&t, "10.0.5.0/24").await;
    let s = sandbox(&t, &tpl, "src").await;
    let sbx = s["id"].as_str().unwrap();

    host.corrupt_uploads(true);
    let bad = take(&t, sbx, json!({})).await;
    let bad = settled(&t, bad["id"].as_str().unwrap()).await;
    assert_eq!(bad["state"], "failed");
    assert!(bad["reason"].as_str().unwrap().contains("400"), "{bad}");
    assert!(
        !object(&t, bad["id"].as_str().unwrap()).exists(),
        "nothing stored"
    );
    host.corrupt_uploads(false);

    let good = take(&t, sbx, json!({ "keep": true })).await;
    let id = good["id"].as_str().unwrap().to_string();
    assert_eq!(settled(&t, &id).await["state"], "ready");
    // The stored bytes change behind the control plane's back: the restoring host refuses them.
    std::fs::write(object(&t, &id), b"tampered").unwrap();
    let restored = restore_of(&t, &tpl, "r", &id).await;
    assert_eq!(restored["state"], "failed", "{restored}");
    let inst = instance(&t, restored["instanceId"].as_str().unwrap()).await;
    assert!(inst["conditions"].to_string().contains("SHA-256"), "{inst}");
}

/// A host written to the SPEC uploads with a plain PUT carrying exactly `uploadHeaders`. The
/// `file` store takes it, hashing what arrives; settlement compares that digest with the one
/// the host reports, so a report naming other bytes settles the snapshot `failed`.
#[tokio::test]
async fn a_plain_put_uploads_and_a_reported_digest_that_is_not_the_stored_bytes_fails_the_snapshot()
{
    let t = server().await;
    let pool = t.hosted_pool("10.0.9.0/24", 0, quota(100)).await;
    let body = json!({ "poolId": pool, "name": "plain", "cpuModel": "epyc",
                       "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 } });
    let answer = t.ok(OPERATOR, "nodes.register", body).await;
    let node_id = answer["node"]["id"].as_str().unwrap().to_string();
    let token = answer["nodeToken"].as_str().unwrap().to_string();
    let mut config = vps_emulators::host::HostConfig::new(t.server.url(), node_id.clone(), &token);
    config.boot_delay = BOOT;
    config.report_interval = Duration::from_millis(200);
    config.poll_wait = Duration::from_millis(1000);
    let host = vps_emulators::host::EmulatedHost::start(config);
    // The emulated host boots the sandbox; this test plays its snapshot part by hand.
    host.hold_commands(true);
    let tpl = template(&t, &pool, "py").await;
    let s = sandbox(&t, &tpl, "plain").await;
    let sbx = s["id"].as_str().unwrap();

    // Uploads `bytes` for snapshot `id` as a SPEC host does, and reports `reported` as its
    // digest; answers the upload's HTTP status.
    let upload_and_report = |id: String, bytes: &'static [u8], reported: String| {
        let (t, token, node_id) = (&t, token.clone(), node_id.clone());
        async move {
            let spec = t
                .ok(&token, "nodes.spec", json!({ "nodeId": node_id }))
                .await;
            let command = spec["commands"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["id"] == id.as_str())
                .cloned()
                .unwrap_or_else(|| panic!("no command {id} in {spec}"));
            let mut put = t.http.put(command["uploadUrl"].as_str().unwrap());
            for (name, value) in command["uploadHeaders"].as_object().unwrap() {
                put = put.header(name, value.as_str().unwrap());
            }
            let status = put.body(bytes).send().await.unwrap().status().as_u16();
            let result = json!({ "id": id, "ok": true, "sha256": reported,
                                 "sizeBytes": bytes.len() });
            t.ok(
                &token,
                "nodes.report",
                json!({ "nodeId": node_id, "instances": [], "complete": false,
                        "commandResults": [result] }),
            )
            .await;
            status
        }
    };
    let digest = |bytes: &[u8]| {
        data_encoding::HEXLOWER.encode(&<sha2::Sha256 as sha2::Digest>::digest(bytes))
    };

    // A plain PUT, no digest header: stored, and the honest report makes it ready.
    let good = take(&t, sbx, json!({})).await;
    let good = good["id"].as_str().unwrap().to_string();
    let status = upload_and_report(good.clone(), b"plain bytes", digest(b"plain bytes")).await;
    assert_eq!(status, 200, "a plain PUT is accepted");
    let ready = settled(&t, &good).await;
    assert_eq!(ready["state"], "ready", "{ready}");
    assert_eq!(ready["sha256"], digest(b"plain bytes"));
    assert_eq!(std::fs::read(object(&t, &good)).unwrap(), b"plain bytes");

    // The host reports the digest of other bytes than it uploaded: failed, digest-mismatch.
    let bad = take(&t, sbx, json!({})).await;
    let bad = bad["id"].as_str().unwrap().to_string();
    let status = upload_and_report(bad.clone(), b"these bytes", digest(b"other bytes")).await;
    assert_eq!(status, 200);
    let failed = settled(&t, &bad).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["reason"], "digest-mismatch", "{failed}");
    drop(host);
}

#[tokio::test]
async fn the_file_store_serves_only_signed_unexpired_urls() {
    let t = server().await;
    let base = t.server.url();
    let put = |url: String, body: &'static [u8], digest: String| {
        let http = t.http.clone();
        async move {
            http.put(url)
                .header("x-content-sha256", digest)
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(t.server.state.snapshots.kind(), "file");
    let digest = data_encoding::HEXLOWER.encode(&<sha2::Sha256 as sha2::Digest>::digest(b"hello"));
    // No signature, a forged one, an expired one: 403.
    assert_eq!(
        put(
            format!("{base}/snapshots/acme/snap_x"),
            b"hello",
            digest.clone()
        )
        .await,
        403
    );
    assert_eq!(
        put(
            format!("{base}/snapshots/acme/snap_x?exp=9999999999&sig=00"),
            b"hello",
            digest.clone()
        )
        .await,
        403
    );
    let short = t
        .server
        .state
        .snapshots
        .upload("acme/snap_x", Duration::from_secs(1))
        .await
        .unwrap();
    t.advance(Duration::from_millis(2100));
    assert_eq!(put(short.url, b"hello", digest.clone()).await, 403);
    let signed = t
        .server
        .state
        .snapshots
        .upload("acme/snap_x", Duration::from_secs(60))
        .await
        .unwrap();
    // A signed PUT with a body that is not the declared one: 400, nothing stored.
    assert_eq!(put(signed.url.clone(), b"other", digest.clone()).await, 400);
    assert_eq!(put(signed.url.clone(), b"hello", digest.clone()).await, 200);
    // A PUT signature does not read; a GET one does.
    let read = t
        .http
        .get(&signed.url)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    assert_eq!(read, 403);
    let get = t
        .server
        .state
        .snapshots
        .download("acme/snap_x", Duration::from_secs(60))
        .await
        .unwrap();
    let body = t
        .http
        .get(&get)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(&body[..], b"hello");
}

/// A moto S3 server (from PyPI, `moto[server]`, which `.ci/run` installs) on a free port,
/// killed when dropped.
struct Moto {
    child: std::process::Child,
    endpoint: String,
}

impl Moto {
    async fn start() -> Moto {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("moto_server runs (pip install 'moto[server]'; .ci/run installs it)");
        let endpoint = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        wait_until("moto answers", PATIENCE, || async {
            http.get(&endpoint).send().await.is_ok()
        })
        .await;
        // The bucket (moto takes any credentials).
        let created = http
            .put(format!("{endpoint}/snapshots"))
            .send()
            .await
            .unwrap();
        assert!(created.status().is_success(), "{}", created.status());
        Moto { child, endpoint }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn the_s3_store_carries_a_snapshot_from_upload_to_restore_to_purge() {
    let moto = Moto::start().await;
    let endpoint = moto.endpoint.clone();
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        c.timings.sandbox_pass = 0.2;
        c.snapshots.store = vps_api::config::SnapshotBackend::S3;
        c.snapshots.bucket = Some("snapshots".into());
        c.snapshots.endpoint = Some(endpoint);
        c.snapshots.region = Some("us-east-1".into());
        c.snapshots.access_key_id = Some("test".into());
        c.snapshots.secret_access_key = Some("test".into());
    })
    .await;
    assert_eq!(t.server.state.snapshots.kind(), "s3");
    let (_, host, tpl) = one_node(&t, "10.0.6.0/24").await;
    let s = sandbox(&t, &tpl, "src").await;
    let snap = take(&t, s["id"].as_str().unwrap(), json!({ "keep": true })).await;
    let id = snap["id"].as_str().unwrap().to_string();
    let ready = settled(&t, &id).await;
    assert_eq!(ready["state"], "ready", "{ready}");
    let key = format!("acme/{id}");
    assert!(
        t.server.state.snapshots.exists(&key).await.unwrap(),
        "the host uploaded to the bucket"
    );
    // A restoring host downloads it from a presigned URL and checks its digest.
    let restored = restore_of(&t, &tpl, "r", &id).await;
    assert_eq!(restored["state"], "ready", "{restored}");
    let inst = restored["instanceId"].as_str().unwrap();
    assert_eq!(
        host.domain(inst).unwrap().restored_from.as_deref(),
        Some(id.as_str())
    );
    // Deleted, and nothing restores from it any more: the object leaves the bucket.
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&restored["id"]))
        .await;
    t.ok(ALICE, "sandboxSnapshots.delete", acme_snapshot(&id))
        .await;
    eventually("the object purged from the bucket", PATIENCE, || async {
        match t.server.state.snapshots.exists(&key).await.unwrap() {
            false => Ok(()),
            true => Err("still there"),
        }
    })
    .await;
}

#[tokio::test]
async fn a_tenant_teardown_deletes_every_snapshot_kept_ones_too() {
    let t = server().await;
    let (_, _host, tpl) = one_node(&t, "10.0.7.0/24").await;
    let s = sandbox(&t, &tpl, "src").await;
    let snap = take(&t, s["id"].as_str().unwrap(), json!({ "keep": true })).await;
    let id = snap["id"].as_str().unwrap().to_string();
    settled(&t, &id).await;
    t.ok(OPERATOR, "tenants.delete", json!({ "tenantId": "acme" }))
        .await;
    t.teardown_done("acme").await;
    let (code, _) = refusal(
        t.call(OPERATOR, "sandboxSnapshots.get", acme_snapshot(&id))
            .await,
    );
    assert_eq!(code, "NOT_FOUND");
    wait_until("the kept object purged", PATIENCE, || async {
        !object(&t, &id).exists()
    })
    .await;
}

#[tokio::test]
async fn a_memory_restore_shares_its_sources_identity_so_exec_waits_for_one_of_them() {
    let t = server().await;
    let (_, _host, tpl) = one_node(&t, "10.0.8.0/24").await;
    let source = sandbox(&t, &tpl, "src").await;
    let exec = |s: &Value| {
        let body =
            json!({ "tenantId": "acme", "sandboxId": s["id"], "publicKey": vps_tests::SSH_KEY });
        t.call(ALICE, "sandboxes.exec", body)
    };
    assert!(exec(&source).await.is_ok(), "alone, the source takes exec");
    let memory = take(&t, source["id"].as_str().unwrap(), json!({ "keep": true })).await;
    // One snapshot of a sandbox is in flight at a time.
    settled(&t, memory["id"].as_str().unwrap()).await;
    let disk = take(
        &t,
        source["id"].as_str().unwrap(),
        json!({ "includeMemory": false, "keep": true }),
    )
    .await;
    let (memory, disk) = (
        memory["id"].as_str().unwrap().to_string(),
        disk["id"].as_str().unwrap().to_string(),
    );
    settled(&t, &memory).await;
    settled(&t, &disk).await;
    // A disk-only restore boots fresh with its own identity: nobody is refused.
    let fresh = restore_of(&t, &tpl, "disk", &disk).await;
    let grant = exec(&fresh).await.unwrap();
    assert_eq!(grant["principal"], fresh["instanceId"]);
    // A memory restore answers to the source's identity: exec into either is refused.
    let restored = restore_of(&t, &tpl, "mem", &memory).await;
    assert_eq!(restored["state"], "ready", "{restored}");
    for s in [&source, &restored] {
        let (code, details) = refusal(exec(s).await);
        assert_eq!(
            (code.as_str(), details["reason"].as_str()),
            ("INVALID_STATE", Some("restore-shares-identity"))
        );
    }
    // Once the source is gone, the restore alone answers to it: the certificate names it.
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&source["id"]))
        .await;
    let grant = eventually("the source gone", PATIENCE, || async {
        exec(&restored).await.map_err(|e| e.body)
    })
    .await;
    assert_eq!(grant["principal"], source["instanceId"]);
}

/// `vps sandboxes exec` into a memory restore asks again while it shares its source's
/// identity, and runs once it does not (here: the source is deleted).
#[tokio::test]
async fn the_cli_exec_into_a_memory_restore_waits_until_it_alone_has_the_identity() {
    let t = server().await;
    let (_, _host, tpl) = one_node(&t, "10.0.10.0/24").await;
    let source = sandbox(&t, &tpl, "src").await;
    let memory = take(&t, source["id"].as_str().unwrap(), json!({ "keep": true })).await;
    let memory = memory["id"].as_str().unwrap().to_string();
    settled(&t, &memory).await;
    let restored = restore_of(&t, &tpl, "mem", &memory).await;
    assert_eq!(restored["state"], "ready", "{restored}");
    let mut exec = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
        .args([
            "sandboxes",
            "exec",
            restored["id"].as_str().unwrap(),
            "--",
            "echo",
            "hi",
        ])
        .env("VPS_URL", t.server.url())
        .env("VPS_TOKEN", ALICE)
        .env("VPS_TENANT", "acme")
        .env("RUST_LOG", "off")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the CLI runs");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        exec.try_wait().unwrap().is_none(),
        "the CLI gave up while the source lived"
    );
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&source["id"]))
        .await;
    let out = tokio::time::timeout(Duration::from_secs(30), exec.wait_with_output())
        .await
        .expect("the CLI ends")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hi");
}

#[tokio::test]
async fn a_sandbox_writing_a_volume_takes_only_disk_snapshots() {
    let t = server().await;
    let pool = t.hosted_pool("10.0.9.0/24", 0, quota(100)).await;
    let (_n, _host) = node(&t, &pool, "n", "epyc", json!({})).await;
    t.ok(ALICE, "sandboxVolumes.create", json!({ "tenantId": "acme", "poolId": pool, "name": "notes", "sizeGiB": 5, "idempotencyKey": "v" })).await;
    let tpl = t
        .sandbox_template(
            &pool,
            "vol",
            json!({ "volumes": [{ "name": "notes", "mountPath": "/workspace" }] }),
        )
        .await;
    let s = sandbox(&t, tpl["id"].as_str().unwrap(), "v").await;
    let sbx = s["id"].as_str().unwrap();
    let (code, details) = refused(&t, sbx, json!({})).await;
    assert_eq!(
        (code.as_str(), details["reason"].as_str()),
        ("INVALID_STATE", Some("memory-snapshot-with-volumes"))
    );
    let disk = take(&t, sbx, json!({ "includeMemory": false })).await;
    assert_eq!(
        settled(&t, disk["id"].as_str().unwrap()).await["state"],
        "ready"
    );
}
