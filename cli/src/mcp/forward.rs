//! The tools that are one API method each take that method's request as their arguments: the
//! input schema is the request's schema from the registry and the arguments are sent as the
//! body, so a tool cannot drift from its method. Three conveniences for an agent, applied
//! alike to the schema and to the body:
//!
//! - `tenantId` may be left out: it defaults to `vps mcp`'s `VPS_TENANT`;
//! - `idempotencyKey` may be left out: a fresh key is sent;
//! - `waitSeconds` (default [`DEFAULT_WAIT`]) stands for the API's `wait`.

use std::sync::Arc;

use rmcp::model::JsonObject;
use serde_json::{json, Value};
use vps_api::registry::Method;

use crate::client::request_schema;

/// How long a method that can wait (`sandboxes.create`, `instances.create`) waits by default,
/// in seconds.
pub const DEFAULT_WAIT: u64 = 20;

/// The tool error of a call that names no tenant when `vps mcp` has none either.
pub const NO_TENANT: &str =
    "INVALID_INPUT: tenantId is missing (pass it, or start `vps mcp` with VPS_TENANT)";

/// The input schema of the tool that calls `method` (`sandboxes.create`): its request schema
/// with the conveniences above. A method the registry lacks has an empty schema, which a unit
/// test rules out.
pub fn input_schema(method: &str) -> Arc<JsonObject> {
    let mut schema = match registered(method).map(request_schema) {
        Some(Value::Object(schema)) => schema,
        _ => JsonObject::new(),
    };
    // The type name and its doc say nothing to a model; the tool's description does.
    schema.remove("title");
    schema.remove("description");
    schema.insert("type".into(), json!("object"));
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.retain(|name| name != "tenantId" && name != "idempotencyKey");
    }
    if let Some(Value::Object(properties)) = schema.get_mut("properties") {
        if let Some(tenant) = properties.get_mut("tenantId") {
            tenant["description"] = json!("The tenant (default: the server's `VPS_TENANT`).");
        }
        if let Some(key) = properties.get_mut("idempotencyKey") {
            key["description"] =
                json!("Makes the create idempotent: a retry with the same key answers the same resource (default: a fresh key).");
        }
        if properties.remove("wait").is_some() {
            properties.insert(
                "waitSeconds".into(),
                json!({
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 30,
                    "description": format!(
                        "Seconds to wait for it to settle, 0 to 30 (default {DEFAULT_WAIT})."
                    ),
                }),
            );
        }
    }
    Arc::new(schema)
}

/// The body of a call to `method` from the tool's arguments, with the conveniences above
/// (`tenant`: `VPS_TENANT`); the tool error's text when the arguments cannot make one.
pub fn body(
    method: &str,
    mut args: JsonObject,
    tenant: Option<&str>,
) -> Result<Value, &'static str> {
    let properties = registered(method)
        .map(request_schema)
        .and_then(|schema| schema.get("properties").and_then(Value::as_object).cloned())
        .unwrap_or_default();
    if properties.contains_key("tenantId") && !args.contains_key("tenantId") {
        let tenant = tenant.ok_or(NO_TENANT)?;
        args.insert("tenantId".into(), json!(tenant));
    }
    if properties.contains_key("idempotencyKey") && !args.contains_key("idempotencyKey") {
        args.insert("idempotencyKey".into(), json!(fresh_key()));
    }
    if properties.contains_key("wait") {
        let seconds = match args.remove("waitSeconds") {
            None => DEFAULT_WAIT,
            Some(value) => value
                .as_u64()
                .ok_or("INVALID_INPUT: waitSeconds is a whole number of seconds, 0 to 30")?,
        };
        if seconds > 0 && !args.contains_key("wait") {
            args.insert(
                "wait".into(),
                json!({ "timeoutMs": seconds.saturating_mul(1000) }),
            );
        }
    }
    Ok(Value::Object(args))
}

/// The registry's method `group.name`.
fn registered(method: &str) -> Option<&'static Method> {
    let (group, name) = method.split_once('.')?;
    vps_api::methods::registry().get(group, name)
}

/// An idempotency key for a create that was given none.
fn fresh_key() -> String {
    format!("mcp-{}", ulid::Ulid::generate().to_string().to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(value: Value) -> JsonObject {
        match value {
            Value::Object(o) => o,
            _ => panic!("an object"),
        }
    }

    #[test]
    fn a_create_needs_only_what_the_server_cannot_default() {
        let schema = input_schema("sandboxes.create");
        assert_eq!(schema["required"], json!(["templateId"]), "{schema:?}");
        let properties = &schema["properties"];
        assert!(properties["ttlSeconds"].is_object(), "{schema:?}");
        assert!(properties["waitSeconds"].is_object(), "{schema:?}");
        assert!(properties.get("wait").is_none(), "{schema:?}");
        let instance = input_schema("instances.create");
        assert_eq!(
            instance["required"],
            json!(["poolId", "flavor", "imageId"]),
            "{instance:?}"
        );
    }

    #[test]
    fn the_body_gets_the_tenant_a_fresh_key_and_the_default_wait() {
        let args = object(json!({ "templateId": "sbxt_x", "ttlSeconds": 900 }));
        let body = body("sandboxes.create", args, Some("acme")).unwrap();
        assert_eq!(body["tenantId"], "acme");
        assert!(body["idempotencyKey"].as_str().unwrap().starts_with("mcp-"));
        assert_eq!(body["wait"], json!({ "timeoutMs": 20000 }));
        assert_eq!(body["ttlSeconds"], 900);

        let args = object(json!({ "tenantId": "other", "sandboxId": "sbx_x", "by": "30m" }));
        let extend = super::body("sandboxes.extend", args, Some("acme")).unwrap();
        assert_eq!(
            extend,
            json!({ "tenantId": "other", "sandboxId": "sbx_x", "by": "30m" })
        );

        let args = object(json!({ "poolId": "pool_x", "waitSeconds": 0 }));
        let no_wait = super::body("instances.create", args, Some("acme")).unwrap();
        assert!(no_wait.get("wait").is_none() && no_wait.get("waitSeconds").is_none());

        let args = object(json!({ "instanceId": "inst_x" }));
        let missing = super::body("instances.get", args, None).unwrap_err();
        assert!(missing.starts_with("INVALID_INPUT: tenantId"), "{missing}");
    }
}
