//! The second security pass (issue 37): what anonymous endpoints say, tenant teardown,
//! bounded request lists, wait caps, cursors, webhook ranges, template counts and the
//! attribute checks of Cedar policies. Each test fails without its fix.

use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{
    acme_sandbox, eventually, quota, Answer, TestServer, ALICE, EVE, OPERATOR, PATIENCE,
};

const BOOT: Duration = Duration::from_millis(50);

/// `GET /readyz` (with `query`), optionally with a bearer token: status and body.
async fn readyz(t: &TestServer, query: &str, token: Option<&str>) -> (u16, Value) {
    let mut request = t.http.get(format!("{}/readyz{query}", t.server.url()));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("readyz answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

/// The error code of a refused call.
fn code(answer: &Answer) -> &str {
    answer.body["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_readyz_answers_only_its_status_from_a_cached_result() {
    let t = TestServer::start().await;
    // A tenant resource a finding could name: a node that never reports.
    let pool = t
        .hosted_pool(
            "10.0.0.0/24",
            1,
            json!({ "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 }),
        )
        .await;

    let (status, body) = readyz(&t, "", None).await;
    assert_eq!((status, &body), (200, &json!({ "ready": true })));
    // Findings need an operator: no token, a tenant's token and a node's are refused.
    let (status, body) = readyz(&t, "?verbose", None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("UNAUTHENTICATED"))
    );
    let (status, body) = readyz(&t, "?verbose", Some(ALICE)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("ACCESS_DENIED"))
    );
    let (status, body) = readyz(&t, "?verbose", Some(OPERATOR)).await;
    assert_eq!(status, 200, "{body}");
    let checks = body["checks"]
        .as_array()
        .expect("the operator sees the findings");
    assert!(checks.iter().any(|f| f["check"] == "vps.nodes.liveness"));
    assert!(!pool.is_empty());

    // The anonymous answer is reused for a second: a migration made to look unapplied just
    // after a check is not seen at once, and is seen once the second has passed.
    let (status, _) = readyz(&t, "", None).await;
    assert_eq!(status, 200);
    let version: i64 =
        sqlx::query_scalar("DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations) RETURNING version")
            .fetch_one(&t.server.state.pool)
            .await
            .unwrap();
    let (status, body) = readyz(&t, "", None).await;
    assert_eq!((status, &body), (200, &json!({ "ready": true })), "cached");
    t.advance(Duration::from_millis(1100));
    let (status, body) = readyz(&t, "", None).await;
    assert_eq!(
        (status, &body),
        (503, &json!({ "ready": false })),
        "checked again"
    );
    let _ = version;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metric_labels_carry_no_tenant_resource_id() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let template = t
        .sandbox_template(&pool, "warm", json!({ "warm": { "min": 1, "max": 1 } }))
        .await;
    let template = template["id"].as_str().unwrap().to_string();
    let metrics = eventually("the warm pool's gauge", PATIENCE, || async {
        let metrics = t.metrics().await;
        if metrics.contains(&format!("vps_sandbox_warm_instances{{pool=\"{pool}\"")) {
            Ok(metrics)
        } else {
            Err("no per-pool warm gauge yet")
        }
    })
    .await;
    assert!(!metrics.contains(&template), "a label names {template}");
    assert!(
        !metrics.contains("template=\""),
        "a label keyed by template"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_tenant_changes_nothing_its_keys_are_revoked_and_its_warm_pools_drain() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let key = t
        .ok(
            OPERATOR,
            "identities.create",
            json!({ "tenantId": "acme", "name": "ci" }),
        )
        .await;
    let (identity, key) = (
        key["identity"]["id"].as_str().unwrap().to_string(),
        key["apiKey"].as_str().unwrap().to_string(),
    );
    let template = json!({ "tenantId": "acme", "name": "warm", "poolId": pool,
                           "flavor": "small", "imageId": "img_ubuntu",
                           "warm": { "min": 1, "max": 1 } });
    let template_id = t
        .ok(&key, "sandboxTemplates.create", template.clone())
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let live_warm = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM instances i JOIN sandbox_templates s ON s.id = i.warm_template_id
              WHERE s.tenant_id = 'acme' AND i.state <> 'deleted'",
        )
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap()
    };
    eventually("a warm instance", PATIENCE, || async {
        match live_warm().await {
            0 => Err(0),
            n => Ok(n),
        }
    })
    .await;

    t.ok(OPERATOR, "tenants.delete", json!({ "tenantId": "acme" }))
        .await;
    // Every change is refused with the reason, not only `*:create` actions.
    let mut renamed = template.clone();
    renamed["name"] = json!("late");
    for (method, body) in [
        ("sandboxTemplates.create", renamed),
        (
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": template_id, "warm": { "min": 2, "max": 2 } }),
        ),
        (
            "sandboxTemplates.delete",
            json!({ "tenantId": "acme", "templateId": template_id }),
        ),
        (
            "webhooks.create",
            json!({ "url": "http://127.0.0.1:9/hook", "types": ["instance.*"] }),
        ),
    ] {
        let refused = t.err(ALICE, method, body).await;
        assert_eq!(
            (
                refused.status,
                code(&refused),
                refused.body["details"]["reason"].as_str()
            ),
            (409, "INVALID_STATE", Some("tenant-deleted")),
            "{method}: {}",
            refused.body
        );
    }
    // Reads still answer.
    t.ok(
        ALICE,
        "sandboxTemplates.list",
        json!({ "tenantId": "acme" }),
    )
    .await;
    // The run-time identity's key is revoked, and the revoke is in the log.
    let revoked = t
        .err(&key, "sandboxTemplates.list", json!({ "tenantId": "acme" }))
        .await;
    assert_eq!(code(&revoked), "UNAUTHENTICATED", "{}", revoked.body);
    t.settle().await;
    let log = t
        .ok(
            OPERATOR,
            "events.list",
            json!({ "types": ["identity.keys.revoked"] }),
        )
        .await;
    let items = log["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{log}");
    assert_eq!(items[0]["data"]["identityId"], identity.as_str());

    // Templates deleted, warm pools drained, and nothing boots again.
    t.teardown_done("acme").await;
    eventually("the warm pool drained", PATIENCE, || async {
        match live_warm().await {
            0 => Ok(()),
            n => Err(n),
        }
    })
    .await;
    let live_templates: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sandbox_templates WHERE tenant_id = 'acme' AND NOT deleted",
    )
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap();
    assert_eq!(live_templates, 0);
    t.quiet().await;
    assert_eq!(
        live_warm().await,
        0,
        "no warm instance boots for a deleted tenant"
    );
    let _ = EVE;
}

/// The refusal of a webhook whose URL reaches a disallowed address.
const NOT_ALLOWED: &str =
    "invalid url: resolves to an address that is not allowed; webhooks may not target it";

/// A name of this machine's `/etc/hosts` (not `localhost`) and the address it resolves to.
fn hosts_name() -> Option<(String, String)> {
    let hosts = std::fs::read_to_string("/etc/hosts").ok()?;
    hosts.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        let address = words.next().filter(|a| !a.starts_with('#'))?;
        let name = words.find(|n| !n.contains("localhost"))?;
        Some((name.to_string(), address.to_string()))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_webhook_url_does_not_say_what_its_host_resolved_to() {
    let t = TestServer::start_with(|c| c.webhooks.allow_private.clear()).await;
    let mut cases = vec![
        ("http://10.1.2.3/h".to_string(), "10.1.2.3".to_string()),
        // A decimal host is an IPv4 literal: the answer must not decode it for the caller.
        ("http://2130706433:9/h".into(), "127.0.0.1".into()),
        ("http://localhost:9/h".into(), "127.0.0.1".into()),
    ];
    if let Some((name, address)) = hosts_name() {
        cases.push((format!("http://{name}:9/h"), address));
    }
    for (url, address) in cases {
        let refused = t
            .err(
                ALICE,
                "webhooks.create",
                json!({ "url": url, "types": ["*"] }),
            )
            .await;
        let message = refused.body["message"].as_str().unwrap();
        assert_eq!(
            (code(&refused), message),
            ("INVALID_INPUT", NOT_ALLOWED),
            "{url}"
        );
        assert!(
            !refused.body.to_string().contains(&address),
            "{url}: {}",
            refused.body
        );
        assert_eq!(refused.body["details"]["field"], "url");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_cannot_target_benchmarking_reserved_6to4_nat64_or_ipv4_compatible_addresses() {
    let t = TestServer::start().await;
    for url in [
        "http://198.18.0.1/h",
        "http://198.19.255.254/h",
        "http://240.0.0.1/h",
        "http://[64:ff9b:1::a00:1]/h",
        "http://[2002:a00:1::1]/h",
        "http://[2002:808:808::1]/h",
        "http://[::a00:1]/h",
        "http://[::808:808]/h",
    ] {
        let refused = t
            .err(
                ALICE,
                "webhooks.create",
                json!({ "url": url, "types": ["*"] }),
            )
            .await;
        assert_eq!(
            (refused.status, code(&refused)),
            (400, "INVALID_INPUT"),
            "{url}: {}",
            refused.body
        );
    }
    // Their public neighbours still may.
    for url in [
        "http://198.20.0.1/h",
        "http://[64:ff9b:2::1]/h",
        "http://[2003::1]/h",
    ] {
        t.ok(
            ALICE,
            "webhooks.create",
            json!({ "url": url, "types": ["*"] }),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_has_at_most_templates_per_tenant_live_templates() {
    let t = TestServer::start_with(|c| c.limits.templates_per_tenant = 2).await;
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota(10)).await;
    let template = |name: &str| {
        json!({ "tenantId": "acme", "name": name, "poolId": pool, "flavor": "small",
                "imageId": "img_ubuntu" })
    };
    let first = t.ok(ALICE, "sandboxTemplates.create", template("a")).await;
    t.ok(ALICE, "sandboxTemplates.create", template("b")).await;
    let refused = t.err(ALICE, "sandboxTemplates.create", template("c")).await;
    assert_eq!(
        (refused.status, code(&refused), &refused.body["details"]),
        (
            409,
            "INVALID_STATE",
            &json!({ "reason": "templates-per-tenant", "max": 2 })
        ),
        "{}",
        refused.body
    );
    // A deleted template frees its place.
    t.ok(
        ALICE,
        "sandboxTemplates.delete",
        json!({ "tenantId": "acme", "templateId": first["id"] }),
    )
    .await;
    t.ok(ALICE, "sandboxTemplates.create", template("c")).await;
}

/// A run-time identity of `tenant` (an operator one when none): its id and API key.
async fn identity(t: &TestServer, tenant: Option<&str>, name: &str) -> (String, String) {
    let body = match tenant {
        Some(tenant) => json!({ "tenantId": tenant, "name": name }),
        None => json!({ "operator": true, "name": name }),
    };
    let created = t.ok(OPERATOR, "identities.create", body).await;
    (
        created["identity"]["id"].as_str().unwrap().to_string(),
        created["apiKey"].as_str().unwrap().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_may_revoke_its_own_identity_to_sign_out_and_no_other() {
    let t = TestServer::start().await;
    let (ci, ci_key) = identity(&t, Some("acme"), "ci").await;
    let (other, other_key) = identity(&t, Some("acme"), "other").await;
    let (ops, ops_key) = identity(&t, None, "ops").await;

    // A tenant's key names only its own identity: another, even of its tenant, is not found.
    let refused = t
        .err(&ci_key, "apiKeys.revoke", json!({ "identityId": other }))
        .await;
    assert_eq!(code(&refused), "NOT_FOUND", "{}", refused.body);
    t.ok(&other_key, "webhooks.list", json!({})).await;

    // Signing out: the key revokes its own identity's keys and is refused from then on.
    let out = t
        .ok(&ci_key, "apiKeys.revoke", json!({ "identityId": ci }))
        .await;
    assert_eq!(
        out,
        json!({ "identityId": ci, "revoked": 1, "signedOut": true })
    );
    let gone = t.err(&ci_key, "webhooks.list", json!({})).await;
    assert_eq!(code(&gone), "UNAUTHENTICATED");

    // An operator's run-time key signs out too, and revokes others' keys without signing out.
    let revoked = t
        .ok(&ops_key, "apiKeys.revoke", json!({ "identityId": other }))
        .await;
    assert_eq!(revoked["signedOut"], false);
    let out = t
        .ok(&ops_key, "apiKeys.revoke", json!({ "identityId": ops }))
        .await;
    assert_eq!(out["signedOut"], true);
    let gone = t.err(&ops_key, "pools.list", json!({})).await;
    assert_eq!(code(&gone), "UNAUTHENTICATED");
    let revocations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE type = 'identity.keys.revoked'")
            .fetch_one(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!(revocations, 3, "each revoke is in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_lists_past_their_bound_are_refused_naming_the_field() {
    let t = TestServer::start().await;
    let patterns = |n: usize| (0..n).map(|i| format!("type{i}.*")).collect::<Vec<_>>();
    // 64 patterns are fine, 65 are not; nor is a pattern of 129 characters.
    t.ok(
        ALICE,
        "webhooks.create",
        json!({ "url": "http://127.0.0.1:9/h", "types": patterns(64) }),
    )
    .await;
    let long = format!("{}.*", "a".repeat(127));
    for (method, body, field) in [
        (
            "webhooks.create",
            json!({ "url": "http://127.0.0.1:9/h", "types": patterns(65) }),
            "types",
        ),
        (
            "webhooks.create",
            json!({ "url": "http://127.0.0.1:9/h", "types": [long.clone()] }),
            "types",
        ),
        // The bound comes before any other check of the list: 100,000 duplicates too.
        (
            "webhooks.create",
            json!({ "url": "http://127.0.0.1:9/h", "types": vec!["*"; 20_000] }),
            "types",
        ),
        ("events.list", json!({ "types": patterns(65) }), "types"),
        (
            "instances.create",
            json!({ "tenantId": "acme", "poolId": "p", "flavor": "small", "imageId": "i",
                    "idempotencyKey": "k", "sshKeys": vec!["ssh-ed25519 AAAA"; 33] }),
            "sshKeys",
        ),
        (
            "sandboxTemplates.create",
            // A well-formed pool id: an id that is not is NOT_FOUND at once (typed at the edge).
            json!({ "tenantId": "acme", "name": "x", "poolId": "pool_01kbq7q9d1x2y3z4a5b6c7d8e9",
                    "flavor": "small", "imageId": "i",
                    "volumes": (0..9).map(|i| json!({ "name": format!("v{i}"), "mountPath": format!("/m{i}") })).collect::<Vec<_>>() }),
            "volumes",
        ),
    ] {
        let refused = t.err(ALICE, method, body).await;
        assert_eq!(
            (
                refused.status,
                code(&refused),
                refused.body["details"]["field"].as_str()
            ),
            (400, "INVALID_INPUT", Some(field)),
            "{method}: {}",
            refused.body
        );
    }
    // The stream's `?types=` filter is bounded the same way.
    let url = format!(
        "{}/api/compute/events/stream?types={}",
        t.server.url(),
        patterns(65).join(",")
    );
    let answer = t.http.get(url).bearer_auth(ALICE).send().await.unwrap();
    assert_eq!(answer.status().as_u16(), 400);

    // The document states every bound, so clients and the fuzzer see them.
    let doc: Value = t
        .http
        .get(format!("{}/api/compute/openapi.json", t.server.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let unbounded = unbounded_arrays(&doc);
    assert!(
        unbounded.is_empty(),
        "request arrays without maxItems: {unbounded:?}"
    );
}

/// The request schemas' array properties that state no `maxItems`.
fn unbounded_arrays(doc: &Value) -> Vec<String> {
    let schemas = doc["components"]["schemas"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let mut requests = std::collections::BTreeSet::new();
    for path in doc["paths"].as_object().into_iter().flatten() {
        for op in path.1.as_object().into_iter().flatten() {
            let body = &op.1["requestBody"]["content"]["application/json"]["schema"];
            collect_refs(body, &schemas, &mut requests);
        }
    }
    let mut unbounded = Vec::new();
    for name in requests {
        let schema = &schemas[&name];
        for (field, property) in schema["properties"].as_object().into_iter().flatten() {
            let is_array = property["type"] == "array"
                || property["type"]
                    .as_array()
                    .is_some_and(|t| t.contains(&json!("array")));
            if is_array && property.get("maxItems").is_none() {
                unbounded.push(format!("{name}.{field}"));
            }
        }
    }
    unbounded
}

/// Every schema `schema` names, transitively.
fn collect_refs(
    schema: &Value,
    schemas: &serde_json::Map<String, Value>,
    seen: &mut std::collections::BTreeSet<String>,
) {
    match schema {
        Value::Object(map) => {
            if let Some(name) = map
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.rsplit('/').next())
            {
                if seen.insert(name.to_string()) {
                    if let Some(target) = schemas.get(name) {
                        collect_refs(target, schemas, seen);
                    }
                }
            }
            for v in map.values() {
                collect_refs(v, schemas, seen);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, schemas, seen)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_replicas_wait_cap_a_create_answers_at_once() {
    let t = TestServer::start_with(|c| c.limits.waits = 1).await;
    let quota = quota(100);
    // A node with no host: instances are placed and never start, so a wait lasts.
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota).await;
    let create = |key: &str, ms: u64| {
        json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
                "idempotencyKey": key, "wait": { "timeoutMs": ms } })
    };
    let first = {
        let (http, url, body) = (t.http.clone(), t.server.url(), create("first", 15_000));
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            http.post(format!("{url}/api/compute/instances/create"))
                .bearer_auth(ALICE)
                .json(&body)
                .send()
                .await
                .unwrap();
            started.elapsed()
        })
    };
    eventually("the first wait holds the one place", PATIENCE, || async {
        match t
            .metrics()
            .await
            .lines()
            .find(|l| l.starts_with("vps_waits "))
        {
            Some(l) if l.ends_with(" 1") => Ok(()),
            other => Err(other.map(str::to_string)),
        }
    })
    .await;
    let started = std::time::Instant::now();
    let second = t
        .ok(ALICE, "instances.create", create("second", 15_000))
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after {:?}",
        started.elapsed()
    );
    assert_ne!(
        second["state"], "running",
        "answered as a wait that timed out"
    );
    assert!(
        first.await.unwrap() >= Duration::from_secs(14),
        "the first waited"
    );
    // The place is given back: a third waits its time out.
    let started = std::time::Instant::now();
    t.ok(ALICE, "instances.create", create("third", 1_500))
        .await;
    assert!(started.elapsed() >= Duration::from_millis(1_400));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_cursor_is_bound_to_its_tenant_and_list() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let quota = quota(100);
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota.clone()).await;
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": pool, "tenantId": "globex", "quota": quota }),
    )
    .await;
    let mut sandboxes = std::collections::HashMap::new();
    for (token, tenant) in [(ALICE, "acme"), (EVE, "globex")] {
        let template = t
            .ok(
                token,
                "sandboxTemplates.create",
                json!({ "tenantId": tenant, "name": "t", "poolId": pool, "flavor": "small",
                        "imageId": "img_ubuntu" }),
            )
            .await;
        for key in ["a", "b"] {
            let sandbox = t
                .ok(
                    token,
                    "sandboxes.create",
                    json!({ "tenantId": tenant, "templateId": template["id"],
                            "idempotencyKey": key }),
                )
                .await;
            sandboxes
                .entry(tenant)
                .or_insert_with(Vec::new)
                .push(sandbox["id"].as_str().unwrap().to_string());
        }
    }
    let page = |token: &'static str, tenant: &'static str, method: &'static str, cursor: Value| {
        let t = &t;
        async move {
            t.call(
                token,
                method,
                json!({ "tenantId": tenant, "limit": 1, "cursor": cursor, "scope": "all" }),
            )
            .await
        }
    };
    // Acme's own cursor pages through its own list.
    let first = page(ALICE, "acme", "sandboxes.list", Value::Null)
        .await
        .unwrap();
    let next = page(ALICE, "acme", "sandboxes.list", first["cursor"].clone())
        .await
        .unwrap();
    let mut seen = vec![
        first["items"][0]["id"].as_str().unwrap().to_string(),
        next["items"][0]["id"].as_str().unwrap().to_string(),
    ];
    seen.sort();
    let mut own = sandboxes["acme"].clone();
    own.sort();
    assert_eq!(seen, own);

    // Globex's sandbox id, globex's cursor, acme's cursor on another list and a made-up one
    // are refused alike: nothing tells acme whether globex's sandbox exists.
    let globex_cursor = page(EVE, "globex", "sandboxes.list", Value::Null)
        .await
        .unwrap()["cursor"]
        .clone();
    let refusals = [
        page(
            ALICE,
            "acme",
            "sandboxes.list",
            json!(sandboxes["globex"][0]),
        )
        .await,
        page(ALICE, "acme", "sandboxes.list", globex_cursor).await,
        page(
            ALICE,
            "acme",
            "sandboxSnapshots.list",
            first["cursor"].clone(),
        )
        .await,
        page(ALICE, "acme", "sandboxes.list", json!("sbx_doesnotexist")).await,
    ];
    let bodies: Vec<Value> = refusals.into_iter().map(|r| r.unwrap_err().body).collect();
    for body in &bodies {
        assert_eq!(body["code"], "INVALID_INPUT", "{body}");
        assert_eq!(body, &bodies[3], "every refusal is the same");
    }
}

/// Every method that makes or changes a shape, the action it is decided as, and the shape it
/// would leave: `(method, action, vcpu, memoryGiB, gpus, diskGiB)`.
const SHAPE_METHODS: [(&str, &str, i64, i64, i64, i64); 3] = [
    ("instances.create", "compute:instances:create", 2, 4, 0, 20),
    ("instances.resize", "compute:instances:update", 8, 16, 0, 20),
    ("sandboxes.create", "compute:sandboxes:create", 2, 4, 0, 20),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbid_on_any_shape_attribute_refuses_every_method_that_makes_that_shape() {
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota(100)).await;
    let template = t.sandbox_template(&pool, "t", json!({})).await;
    let instance = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
                    "imageId": "img_ubuntu", "idempotencyKey": "resized",
                    "desiredState": "stopped" }),
        )
        .await;
    let mut n = 0;
    for (method, action, vcpu, memory, gpus, disk) in SHAPE_METHODS {
        for (attribute, value) in [
            ("vcpu", vcpu),
            ("memoryGiB", memory),
            ("gpus", gpus),
            ("diskGiB", disk),
        ] {
            // At the shape's own value the forbid holds; one above it, it does not.
            for (bound, refused) in [(value, true), (value + 1, false)] {
                n += 1;
                let text = format!(
                    "forbid (principal, action == Action::\"{action}\", resource) \
                     when {{ resource.{attribute} >= {bound} }};"
                );
                t.ok(
                    OPERATOR,
                    "policies.put",
                    json!({ "id": "shape", "text": text }),
                )
                .await;
                let body = match method {
                    "instances.create" => json!({ "tenantId": "acme", "poolId": pool,
                        "flavor": "small", "imageId": "img_ubuntu",
                        "idempotencyKey": format!("k{n}") }),
                    "instances.resize" => json!({ "tenantId": "acme",
                        "instanceId": instance["id"], "flavor": "large" }),
                    _ => json!({ "tenantId": "acme", "templateId": template["id"],
                        "idempotencyKey": format!("k{n}") }),
                };
                let answer = t.call(ALICE, method, body).await;
                let denied = matches!(&answer, Err(a) if code(a) == "ACCESS_DENIED");
                assert_eq!(
                    denied, refused,
                    "{method}: forbid when {attribute} >= {bound}: {answer:?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_of_a_template_whose_flavor_is_archived_is_refused() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (pool, _hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    // A warm pool: a claim admits no instance, so only the create's own check can refuse it.
    let template = t
        .sandbox_template(&pool, "t", json!({ "warm": { "min": 1, "max": 1 } }))
        .await;
    eventually("a settled warm instance", PATIENCE, || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM instances WHERE warm_template_id = $1 AND state = 'paused'",
        )
        .bind(template["id"].as_str().unwrap())
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
        if n == 1 {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
    // A forbid on every shape: a create decided without its shape would pass it.
    let forbid = r#"forbid (principal, action == Action::"compute:sandboxes:create", resource)
                    when { resource.vcpu >= 0 };"#;
    t.ok(
        OPERATOR,
        "policies.put",
        json!({ "id": "no-sandboxes", "text": forbid }),
    )
    .await;
    let flavors = t.ok(ALICE, "flavors.list", json!({ "poolId": pool })).await;
    let small = flavors["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "small")
        .unwrap()["id"]
        .clone();
    t.ok(OPERATOR, "flavors.archive", json!({ "flavorId": small }))
        .await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    let refused = t
        .err(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": template["id"], "idempotencyKey": "k" }),
        )
        .await;
    assert_eq!(
        (code(&refused), refused.body["message"].as_str()),
        ("NOT_FOUND", Some("flavor small not found")),
        "{}",
        refused.body
    );
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    assert_eq!(before, after, "nothing written");
}

/// A snapshot's state, read until it leaves `pending`.
async fn snapshot_settled(t: &TestServer, id: &str) -> Value {
    eventually(&format!("snapshot {id} settled"), PATIENCE, || async {
        let s = t
            .ok(
                ALICE,
                "sandboxSnapshots.get",
                json!({ "tenantId": "acme", "snapshotId": id }),
            )
            .await;
        if s["state"] == "pending" {
            Err(s)
        } else {
            Ok(s)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_one_at_a_time_within_the_kept_quota_and_metered() {
    let t = TestServer::start_with(|c| {
        vps_tests::fast_sandboxes(c);
        c.timings.snapshot_timeout = 60.0;
        c.timings.usage_window = 0.5;
        c.limits.snapshots_per_tenant = 2;
    })
    .await;
    let (pool, hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let template = t.sandbox_template(&pool, "t", json!({})).await;
    let sandbox = t.ready_sandbox(&template["id"], "s", json!({})).await;
    let take = |keep: bool| {
        t.call(
            ALICE,
            "sandboxes.snapshot",
            json!({ "tenantId": "acme", "sandboxId": sandbox["id"], "keep": keep,
                    "includeMemory": false }),
        )
    };

    // One in flight: while the host has not reported the first, a second is a conflict
    // naming it.
    hosts[0].set_reporting(false);
    let first = take(true).await.unwrap();
    let refused = take(true).await.unwrap_err();
    assert_eq!(
        (
            refused.status,
            code(&refused),
            &refused.body["details"]["snapshotId"]
        ),
        (409, "CONFLICT", &first["id"]),
        "{}",
        refused.body
    );
    hosts[0].set_reporting(true);
    assert_eq!(
        snapshot_settled(&t, first["id"].as_str().unwrap()).await["state"],
        "ready"
    );

    // Kept snapshots are counted: the second fits, the third is over the allowance.
    let second = take(true).await.unwrap();
    snapshot_settled(&t, second["id"].as_str().unwrap()).await;
    let over = take(true).await.unwrap_err();
    assert_eq!(
        (code(&over), &over.body["details"]),
        (
            "QUOTA_EXCEEDED",
            &json!({ "resource": "snapshots", "requested": 1, "max": 2, "used": 2 })
        ),
        "{}",
        over.body
    );
    // One that goes with its sandbox is not a kept one.
    let unkept = take(false).await.unwrap();
    snapshot_settled(&t, unkept["id"].as_str().unwrap()).await;

    // The sandbox's row does not grow with its snapshot history; `sandboxes.get` still
    // answers its live snapshots, from their own projection.
    let holds: bool = sqlx::query_scalar("SELECT doc ? 'snapshots' FROM sandboxes WHERE id = $1")
        .bind(sandbox["id"].as_str().unwrap())
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    assert!(!holds, "the sandbox document holds no snapshots");
    let got = t
        .ok(ALICE, "sandboxes.get", acme_sandbox(&sandbox["id"]))
        .await;
    let listed: Vec<&str> = got["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [&first["id"], &second["id"], &unkept["id"]].map(|v| v.as_str().unwrap())
    );
    assert!(t.replay_equal().await);

    // Stored bytes are metered from the log, and `usage verify` recomputes the same.
    let first_id = first["id"].as_str().unwrap().to_string();
    eventually("the first snapshot's GiB hours", PATIENCE, || async {
        let page = t
            .ok(
                ALICE,
                "usage.list",
                json!({ "tenantId": "acme", "from": "2000-01-01T00:00:00Z",
                        "to": "2100-01-01T00:00:00Z", "resourceId": first_id,
                        "meter": "vps.snapshot.gib.hours" }),
            )
            .await;
        match page["items"].as_array() {
            Some(items) if !items.is_empty() => Ok(items.clone()),
            _ => Err(page),
        }
    })
    .await;
    let windows = vps_api::server::usage_windows(&t.server.state.config);
    let report = vps_reactors::usage::verify::verify(
        &t.server.state.pool,
        windows,
        chrono::DateTime::<chrono::Utc>::MIN_UTC,
        vps_clock::Clock::system().now() + chrono::Duration::days(1),
    )
    .await
    .expect("verify runs");
    assert_eq!(report.first_difference, None);
    assert!(report.compared > 0);
}
