//! The tenant isolation matrix, generated from the registry: every method a tenant can call is
//! called by tenant `acme` with tenant `globex`'s ids, and answers `NOT_FOUND` (or, for a
//! method that takes no id, shows none of globex's) without changing the log. A node token
//! calling any method but its own node's is `ACCESS_DENIED`, and so is a tenant calling any
//! operator method.
//!
//! Methods added later are picked up from `vps_api::methods::all()`: a tenant-callable method
//! without an entry in [`fixture`] fails the test, naming it. Add its entry there, using the
//! ids of globex's resources in [`Globex`] (create more of them in [`Globex::create`]).

use serde_json::{json, Value};
use vps_api::registry::Access;
use vps_tests::{acme_sandbox, TestServer, ALICE, EVE, OPERATOR, SSH_KEY};

/// Tenant globex's resources, which acme must never reach.
struct Globex {
    pool: String,
    instance: String,
    webhook: String,
    image: String,
    node: String,
    node_token: String,
    template: String,
    sandbox: String,
    snapshot: String,
    /// Runs globex's sandbox, so it can be snapshotted.
    _host: vps_emulators::host::HostHandle,
    volume: String,
}

impl Globex {
    async fn create(t: &TestServer) -> Globex {
        let quota = json!({ "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 });
        // A pool offered to globex only (hosted_pool offers to acme: withdraw nothing, make another).
        let pool = t
            .ok(
                OPERATOR,
                "pools.create",
                json!({ "name": "globex-only", "class": "vps-host" }),
            )
            .await;
        let pool = pool["id"].as_str().unwrap().to_string();
        t.ok(
            OPERATOR,
            "pools.setIpPool",
            json!({ "poolId": pool, "cidr": "10.9.0.0/28" }),
        )
        .await;
        t.ok(
            OPERATOR,
            "pools.offer",
            json!({ "poolId": pool, "tenantId": "globex", "quota": quota }),
        )
        .await;
        t.ok(
            OPERATOR,
            "flavors.create",
            json!({ "poolId": pool, "name": "small", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 }),
        )
        .await;
        let (node, node_token) = t.register_node(&pool, "globex-host").await;
        t.ok(OPERATOR, "images.register", json!({ "imageId": "img_globex", "tenantId": "globex", "url": "https://images.example/g.qcow2", "sha256": "c".repeat(64), "format": "qcow2" })).await;
        let inst = t.ok(EVE, "instances.create", json!({ "tenantId": "globex", "poolId": pool, "flavor": "small", "imageId": "img_globex", "sshKeys": [SSH_KEY], "idempotencyKey": "g" })).await;
        let hook = t
            .ok(
                EVE,
                "webhooks.create",
                json!({ "url": "http://127.0.0.1:9/g", "types": ["instance.*"] }),
            )
            .await;
        let tpl = t.ok(EVE, "sandboxTemplates.create", json!({ "tenantId": "globex", "name": "g", "poolId": pool, "flavor": "small", "imageId": "img_globex" })).await;
        let template = tpl["id"].as_str().unwrap().to_string();
        let host = t.host(&node, &node_token, std::time::Duration::from_millis(20));
        let sbx = t
            .ok(
                EVE,
                "sandboxes.create",
                json!({ "tenantId": "globex", "templateId": template, "idempotencyKey": "g",
                        "wait": { "timeoutMs": 20000 } }),
            )
            .await;
        let snap = t
            .ok(
                EVE,
                "sandboxes.snapshot",
                json!({ "tenantId": "globex", "sandboxId": sbx["id"] }),
            )
            .await;
        let snapshot = snap["id"].as_str().unwrap().to_string();
        // Settled before the matrix runs, so nothing of globex's moves the log meanwhile.
        vps_tests::wait_until("globex's snapshot ready", vps_tests::PATIENCE, || async {
            let s = t
                .ok(
                    EVE,
                    "sandboxSnapshots.get",
                    json!({ "tenantId": "globex", "snapshotId": snapshot }),
                )
                .await;
            s["state"] == "ready"
        })
        .await;
        let vol = t
            .ok(
                EVE,
                "sandboxVolumes.create",
                json!({ "tenantId": "globex", "poolId": pool, "name": "g", "sizeGiB": 10, "idempotencyKey": "g" }),
            )
            .await;
        Globex {
            snapshot,
            _host: host,
            volume: vol["id"].as_str().unwrap().to_string(),
            template,
            sandbox: sbx["id"].as_str().unwrap().to_string(),
            pool,
            instance: inst["id"].as_str().unwrap().to_string(),
            webhook: hook["id"].as_str().unwrap().to_string(),
            image: "img_globex".into(),
            node,
            node_token,
        }
    }

    /// Every id of globex's, to look for in answers.
    fn ids(&self) -> Vec<&str> {
        vec![
            &self.pool,
            &self.instance,
            &self.webhook,
            &self.image,
            &self.node,
            &self.template,
            &self.sandbox,
            &self.snapshot,
            &self.volume,
        ]
    }
}

/// What acme's call must answer.
enum Fixture {
    /// `NOT_FOUND` for each body.
    NotFound(Vec<Value>),
    /// An answer that names none of globex's ids (methods that take no id).
    OwnOnly(Value),
}

/// The matrix's entry for a tenant-callable method. `None`: no entry yet (the test fails).
fn fixture(method: &str, g: &Globex) -> Option<Fixture> {
    use Fixture::{NotFound, OwnOnly};
    let instance = |tenant: &str| json!({ "tenantId": tenant, "instanceId": g.instance });
    // Both ways in: naming globex, and naming acme with globex's id.
    let instance_refs = vec![instance("globex"), instance("acme")];
    Some(match method {
        "instances.create" => NotFound(vec![
            json!({ "tenantId": "globex", "poolId": g.pool, "flavor": "small", "imageId": g.image, "idempotencyKey": "x" }),
            json!({ "tenantId": "acme", "poolId": g.pool, "flavor": "small", "imageId": g.image, "idempotencyKey": "x" }),
        ]),
        "instances.get" | "instances.start" | "instances.stop" | "instances.delete"
        | "instances.history" => NotFound(instance_refs),
        "instances.resize" => NotFound(vec![
            json!({ "tenantId": "globex", "instanceId": g.instance, "flavor": "small" }),
            json!({ "tenantId": "acme", "instanceId": g.instance, "flavor": "small" }),
        ]),
        "instances.setLabels" => NotFound(vec![
            json!({ "tenantId": "globex", "instanceId": g.instance, "labels": { "team": "x" } }),
            json!({ "tenantId": "acme", "instanceId": g.instance, "labels": { "team": "x" } }),
        ]),
        "instances.list" => NotFound(vec![json!({ "tenantId": "globex" })]),
        "flavors.list" => NotFound(vec![json!({ "poolId": g.pool })]),
        "images.list" => NotFound(vec![json!({ "tenantId": "globex" })]),
        "webhooks.create" => NotFound(vec![
            json!({ "url": "http://127.0.0.1:9/x", "types": ["*"], "tenantId": "globex" }),
        ]),
        "webhooks.delete" | "webhooks.deliveries" => {
            NotFound(vec![json!({ "webhookId": g.webhook })])
        }
        "webhooks.list" => OwnOnly(json!({})),
        "sandboxTemplates.create" => NotFound(vec![
            json!({ "tenantId": "globex", "name": "x", "poolId": g.pool, "flavor": "small", "imageId": g.image }),
            json!({ "tenantId": "acme", "name": "x", "poolId": g.pool, "flavor": "small", "imageId": g.image }),
        ]),
        "sandboxTemplates.get" | "sandboxTemplates.delete" => NotFound(vec![
            json!({ "tenantId": "globex", "templateId": g.template }),
            json!({ "tenantId": "acme", "templateId": g.template }),
        ]),
        "sandboxTemplates.update" => NotFound(vec![
            json!({ "tenantId": "globex", "templateId": g.template, "defaultTtlSeconds": 60 }),
            json!({ "tenantId": "acme", "templateId": g.template, "defaultTtlSeconds": 60 }),
        ]),
        "usage.list" => NotFound(vec![
            json!({ "tenantId": "globex", "from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z" }),
        ]),
        "sandboxTemplates.list" | "sandboxes.list" => {
            NotFound(vec![json!({ "tenantId": "globex" })])
        }
        "sandboxes.create" => NotFound(vec![
            json!({ "tenantId": "globex", "templateId": g.template, "idempotencyKey": "x" }),
            json!({ "tenantId": "acme", "templateId": g.template, "idempotencyKey": "x" }),
        ]),
        "sandboxes.get" | "sandboxes.delete" | "sandboxes.pause" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox }),
            acme_sandbox(&g.sandbox),
        ]),
        "sandboxes.resume" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "ttlSeconds": 60 }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "ttlSeconds": 60 }),
        ]),
        "sandboxes.setLabels" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "labels": { "team": "x" } }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "labels": { "team": "x" } }),
        ]),
        "sandboxTemplates.setLabels" => NotFound(vec![
            json!({ "tenantId": "globex", "templateId": g.template, "labels": { "team": "x" } }),
            json!({ "tenantId": "acme", "templateId": g.template, "labels": { "team": "x" } }),
        ]),
        "sandboxes.extend" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "by": "1m" }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "by": "1m" }),
        ]),
        "sandboxes.snapshot" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox }),
            acme_sandbox(&g.sandbox),
        ]),
        "sandboxSnapshots.list" => NotFound(vec![json!({ "tenantId": "globex" })]),
        "sandboxSnapshots.get" | "sandboxSnapshots.delete" => NotFound(vec![
            json!({ "tenantId": "globex", "snapshotId": g.snapshot }),
            json!({ "tenantId": "acme", "snapshotId": g.snapshot }),
        ]),
        "sandboxes.exec" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "publicKey": SSH_KEY }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "publicKey": SSH_KEY }),
        ]),
        "sandboxes.fork" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "count": 1, "idempotencyKey": "x" }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "count": 1, "idempotencyKey": "x" }),
        ]),
        "sandboxes.expose" | "sandboxes.unexpose" => NotFound(vec![
            json!({ "tenantId": "globex", "sandboxId": g.sandbox, "port": 8080 }),
            json!({ "tenantId": "acme", "sandboxId": g.sandbox, "port": 8080 }),
        ]),
        "sandboxVolumes.create" => NotFound(vec![
            json!({ "tenantId": "globex", "poolId": g.pool, "name": "x", "sizeGiB": 1, "idempotencyKey": "x" }),
            json!({ "tenantId": "acme", "poolId": g.pool, "name": "x", "sizeGiB": 1, "idempotencyKey": "x" }),
        ]),
        "sandboxVolumes.get" | "sandboxVolumes.delete" => NotFound(vec![
            json!({ "tenantId": "globex", "volumeId": g.volume }),
            json!({ "tenantId": "acme", "volumeId": g.volume }),
        ]),
        "sandboxVolumes.resize" => NotFound(vec![
            json!({ "tenantId": "globex", "volumeId": g.volume, "sizeGiB": 20 }),
            json!({ "tenantId": "acme", "volumeId": g.volume, "sizeGiB": 20 }),
        ]),
        "sandboxVolumes.setLabels" => NotFound(vec![
            json!({ "tenantId": "globex", "volumeId": g.volume, "labels": { "team": "x" } }),
            json!({ "tenantId": "acme", "volumeId": g.volume, "labels": { "team": "x" } }),
        ]),
        "sandboxVolumes.list" => NotFound(vec![json!({ "tenantId": "globex" })]),
        "secrets.put" => NotFound(vec![
            json!({ "tenantId": "globex", "name": "x", "value": "v" }),
        ]),
        "events.list" => OwnOnly(json!({ "subject": format!("instance/{}", g.instance) })),
        // A key signs out only its own identity: globex's is not found.
        "apiKeys.revoke" => NotFound(vec![json!({ "identityId": "id_eve" })]),
        _ => return None,
    })
}

async fn log_head(t: &TestServer) -> (i64, Option<i64>) {
    sqlx::query_as("SELECT count(*), max(position) FROM events")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn no_tenant_method_reaches_another_tenants_resources() {
    let t = TestServer::start().await;
    t.hosted_pool(
        "10.0.0.0/28",
        1,
        json!({ "vcpu": 8, "memoryGiB": 32, "diskGiB": 200 }),
    )
    .await;
    let g = Globex::create(&t).await;
    t.settle().await;
    let before = log_head(&t).await;
    let mut missing = Vec::new();
    for method in vps_api::methods::all()
        .iter()
        .filter(|m| m.access == Access::Tenant)
    {
        let name = method.full_name();
        let Some(fixture) = fixture(&name, &g) else {
            missing.push(name);
            continue;
        };
        match fixture {
            Fixture::NotFound(bodies) => {
                for body in bodies {
                    let answer = t.call(ALICE, &name, body.clone()).await;
                    let refused = answer.expect_err(&format!("{name} {body} answered"));
                    assert_eq!(
                        refused.body["code"], "NOT_FOUND",
                        "{name} {body}: {}",
                        refused.body
                    );
                }
            }
            Fixture::OwnOnly(body) => {
                let answer = t.ok(ALICE, &name, body).await.to_string();
                for id in g.ids() {
                    assert!(!answer.contains(id), "{name} shows globex's {id}: {answer}");
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "no isolation fixture for {missing:?}: add them to `fixture`"
    );
    // Every operator method (pools, nodes, flavors, images, identities, policies, tenants, …)
    // is ACCESS_DENIED to a tenant, whatever it names.
    for method in vps_api::methods::all()
        .iter()
        .filter(|m| m.access == Access::Operator)
    {
        let name = method.full_name();
        for body in [
            json!({}),
            json!({ "tenantId": "globex", "poolId": g.pool, "id": "x" }),
        ] {
            let refused = t
                .call(ALICE, &name, body.clone())
                .await
                .expect_err(&format!("{name} {body} answered"));
            assert_eq!(
                refused.body["code"], "ACCESS_DENIED",
                "{name} {body}: {}",
                refused.body
            );
        }
    }
    t.settle().await;
    assert_eq!(log_head(&t).await, before, "the log is unchanged");
}

#[tokio::test]
async fn a_node_token_may_call_only_its_own_nodes_methods() {
    let t = TestServer::start().await;
    t.hosted_pool(
        "10.0.0.0/28",
        1,
        json!({ "vcpu": 8, "memoryGiB": 32, "diskGiB": 200 }),
    )
    .await;
    let g = Globex::create(&t).await;
    t.settle().await;
    let before = log_head(&t).await;
    for method in vps_api::methods::all()
        .iter()
        .filter(|m| m.access != Access::Node)
    {
        let name = method.full_name();
        let bodies = match fixture(&name, &g) {
            Some(Fixture::NotFound(bodies)) => bodies,
            Some(Fixture::OwnOnly(body)) => vec![body],
            None => vec![json!({}), json!({ "tenantId": "globex", "nodeId": g.node })],
        };
        for body in bodies {
            let refused = t
                .call(&g.node_token, &name, body.clone())
                .await
                .expect_err(&name);
            assert_eq!(
                refused.body["code"], "ACCESS_DENIED",
                "{name} {body}: {}",
                refused.body
            );
        }
    }
    t.settle().await;
    assert_eq!(log_head(&t).await, before, "the log is unchanged");
}
