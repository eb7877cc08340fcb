//! The API as a registry: the served OpenAPI document covers every method, and the parsing
//! rules every method shares (objects only, unknown fields refused, no NUL characters, node
//! tokens kept to their own node) answer the documented codes.

use serde_json::{json, Value};
use vps_tests::{TestServer, ALICE, OPERATOR};

async fn document(t: &TestServer) -> Value {
    t.http
        .get(format!("{}/api/compute/openapi.json", t.server.url()))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("JSON")
}

/// Whether `schema` says what an answer holds: an object with properties, and the items of
/// any list answer likewise (not "any JSON value").
fn described(doc: &Value, schema: &Value) -> bool {
    let resolve = |s: &Value| match s["$ref"].as_str() {
        Some(r) => doc["components"]["schemas"][r.rsplit('/').next().unwrap()].clone(),
        None => s.clone(),
    };
    let schema = resolve(schema);
    let Some(properties) = schema["properties"].as_object() else {
        return false;
    };
    match properties.get("items") {
        Some(items) if items["type"] == "array" => {
            let item = resolve(&items["items"]);
            item["properties"].is_object() || item["enum"].is_array()
        }
        _ => !properties.is_empty(),
    }
}

#[tokio::test]
async fn the_document_covers_every_method_with_its_schemas_and_errors() {
    let t = TestServer::start().await;
    let doc = document(&t).await;
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let methods = vps_api::methods::registry().methods();
    assert!(methods.len() >= 38, "{} methods", methods.len());
    for m in methods {
        let path = format!("/api/compute/{}/{}", m.group, m.name);
        let op = &doc["paths"][&path]["post"];
        assert_eq!(op["operationId"], m.full_name(), "{path}");
        for status in ["200", "400", "401", "403", "404", "409", "422", "500"] {
            assert!(
                op["responses"][status].is_object(),
                "{path} documents {status}"
            );
        }
        let request = &op["requestBody"]["content"]["application/json"]["schema"];
        assert!(request.is_object(), "{path} has a request schema");
        let answer = &op["responses"]["200"]["content"]["application/json"]["schema"];
        assert!(
            described(&doc, answer),
            "{path} describes its answer: {answer}"
        );
    }
    // Request types come from the Rust types: unknown fields refused, required fields named.
    let create = &doc["components"]["schemas"]["CreateBody"];
    assert_eq!(create["additionalProperties"], false);
    let required: Vec<&str> = create["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(required.contains(&"idempotencyKey"), "{required:?}");
    // `vps openapi` prints the same document.
    assert_eq!(&doc, vps_api::openapi::document());
}

#[tokio::test]
async fn bodies_are_objects_without_unknown_fields_or_nul_characters() {
    let t = TestServer::start().await;
    for (method, body, field) in [
        ("pools.list", json!([]), "body"),
        ("pools.list", json!({ "extra": 1 }), "extra"),
        ("images.list", json!({ "tenantId": "a\u{0}b" }), "tenantId"),
        (
            "instances.list",
            json!({ "tenantId": "acme", "cursor": "-99999999999999999.inst_x" }),
            "cursor",
        ),
        (
            "instances.list",
            json!({ "tenantId": "acme", "state": "sleeping" }),
            "state",
        ),
    ] {
        let refused = t.err(OPERATOR, method, body.clone()).await;
        assert_eq!(refused.status, 400, "{method} {body}: {}", refused.body);
        assert_eq!(refused.body["code"], "INVALID_INPUT");
        let named = refused.body["details"]["field"].as_str().unwrap();
        assert!(named.starts_with(field), "{method} {body}: field {named}");
    }
    // An empty body is `{}` for methods without required fields.
    let answer = t
        .http
        .post(format!("{}/api/compute/pools/list", t.server.url()))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let unknown = t.err(ALICE, "pools.nothing", json!({})).await;
    assert_eq!(unknown.body["code"], "NOT_FOUND");
}

/// Ids are parsed once, at the edge: one that is not well formed names nothing, so it is
/// `NOT_FOUND` like a well-formed one that names nothing, before any handler runs.
#[tokio::test]
async fn a_malformed_id_is_not_found_naming_its_kind() {
    let t = TestServer::start().await;
    for (method, body, named) in [
        (
            "instances.get",
            json!({ "tenantId": "acme", "instanceId": "inst_x" }),
            "instance inst_x",
        ),
        (
            "sandboxes.get",
            json!({ "tenantId": "acme", "sandboxId": "inst_x" }),
            "sandbox inst_x",
        ),
        (
            "flavors.list",
            json!({ "poolId": "pool_NOT_A_ULID" }),
            "pool pool_NOT_A_ULID",
        ),
    ] {
        let refused = t.err(OPERATOR, method, body.clone()).await;
        assert_eq!(refused.status, 404, "{method} {body}: {}", refused.body);
        assert_eq!(refused.body["code"], "NOT_FOUND");
        let message = refused.body["message"].as_str().unwrap_or_default();
        assert!(message.contains(named), "{method}: {message}");
    }
}

#[tokio::test]
async fn a_node_token_calls_only_its_own_nodes_methods() {
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.9.0.0/24", 0, json!({ "vcpu": 8 })).await;
    let (node, token) = t.register_node(&pool, "solo").await;
    for (method, body) in [
        ("images.list", json!({})),
        ("flavors.list", json!({ "poolId": pool })),
        ("instances.list", json!({ "tenantId": "acme" })),
        ("events.list", json!({})),
        ("pools.list", json!({})),
    ] {
        let refused = t.err(&token, method, body).await;
        assert_eq!(refused.body["code"], "ACCESS_DENIED", "{method}");
    }
    let spec = t.ok(&token, "nodes.spec", json!({ "nodeId": node })).await;
    assert!(spec["generation"].is_number(), "{spec}");
}
