//! The OpenAPI 3.1 document, generated from the method registry: every method's request and
//! answer schema comes from its Rust types (schemars), so the document cannot drift from what
//! the server parses and answers. Served at `GET /api/compute/openapi.json`; `vps openapi`
//! prints it.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use axum::Json;
use schemars::generate::SchemaSettings;
use serde_json::{json, Map, Value};
use vps_domain::ErrorCode;

use crate::error::{self, ErrorBody};
use crate::methods::registry;
use crate::registry::Method;

/// Every HTTP status an error answer can have, with its codes (SPEC §5), from
/// [`error::status`].
fn errors() -> BTreeMap<u16, Vec<ErrorCode>> {
    let mut by_status: BTreeMap<u16, Vec<ErrorCode>> = BTreeMap::new();
    for code in ErrorCode::ALL {
        by_status
            .entry(error::status(code).as_u16())
            .or_default()
            .push(code);
    }
    by_status
}

/// The document, built once.
pub fn document() -> &'static Value {
    static DOCUMENT: LazyLock<Value> = LazyLock::new(build);
    &DOCUMENT
}

/// `GET /api/compute/openapi.json` (no token needed: the document holds no secrets).
pub async fn serve() -> Json<Value> {
    Json(document().clone())
}

fn build() -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|s| {
            s.definitions_path = "/components/schemas".into();
            s.meta_schema = None;
        })
        .into_generator();
    let mut paths = Map::new();
    for method in registry().methods() {
        let request = (method.request)(&mut generator).to_value();
        let answer = (method.answer)(&mut generator).to_value();
        paths.insert(
            format!("/api/compute/{}/{}", method.group, method.name),
            json!({ "post": operation(method, request, answer) }),
        );
    }
    let error = generator.subschema_for::<ErrorBody>().to_value();
    let schemas = generator.take_definitions(true);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "vps compute API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Every method is POST /api/compute/<group>/<method> with a JSON body \
                            (camelCase; unknown fields are refused) and a bearer token.",
        },
        "security": [{ "bearer": [] }],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "responses": error_responses(&error),
        },
    })
}

fn operation(method: &Method, request: Value, answer: Value) -> Value {
    let mut responses = Map::new();
    responses.insert(
        "200".into(),
        json!({ "description": "The answer.", "content": { "application/json": { "schema": answer } } }),
    );
    for status in errors().keys() {
        responses.insert(
            status.to_string(),
            json!({ "$ref": format!("#/components/responses/E{status}") }),
        );
    }
    json!({
        "operationId": method.full_name(),
        "tags": [method.group],
        "summary": method.summary,
        "description": format!(
            "Who may call it: {}. Cedar action `{}` on `{}`.",
            method.access.describe(),
            method.action,
            method.resource
        ),
        "requestBody": {
            "required": !method.body_optional,
            "content": { "application/json": { "schema": request } },
        },
        "responses": responses,
    })
}

fn error_responses(error: &Value) -> Value {
    let responses: Map<String, Value> = errors()
        .into_iter()
        .map(|(status, codes)| {
            let codes: Vec<&str> = codes.into_iter().map(ErrorCode::as_str).collect();
            let response = json!({
                "description": codes.join(" or "),
                "content": { "application/json": { "schema": error } },
            });
            (format!("E{status}"), response)
        })
        .collect();
    Value::Object(responses)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes a schema allows: an `enum`, or a `oneOf` of `const`s (when the variants
    /// carry descriptions).
    fn allowed(schema: &Value) -> Vec<String> {
        let strings = |v: &Value| v.as_str().map(str::to_owned);
        match schema["enum"].as_array() {
            Some(values) => values.iter().filter_map(strings).collect(),
            None => schema["oneOf"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| strings(&v["const"]))
                .collect(),
        }
    }

    #[test]
    fn every_error_code_is_in_the_error_schema_with_its_status() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        let body = &schemas["ErrorBody"]["properties"]["code"];
        let code_schema = match body["$ref"].as_str() {
            Some(r) => &schemas[r.rsplit('/').next().unwrap_or_default()],
            None => body,
        };
        let allowed = allowed(code_schema);
        let responses = &doc["components"]["responses"];
        let create = &doc["paths"]["/api/compute/instances/create"]["post"]["responses"];
        for code in ErrorCode::ALL {
            assert!(
                allowed.iter().any(|c| c == code.as_str()),
                "{code}: {allowed:?}"
            );
            let status = error::status(code).as_u16();
            let response = &responses[format!("E{status}")];
            let description = response["description"].as_str().unwrap_or_default();
            assert!(
                description.split(" or ").any(|c| c == code.as_str()),
                "{code} under {status}: {description:?}"
            );
            assert!(create[status.to_string()].is_object(), "{code}: {status}");
        }
        assert_eq!(allowed.len(), ErrorCode::ALL.len(), "{allowed:?}");
    }
}
