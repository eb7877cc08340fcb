//! The OpenAPI 3.1 document, generated from the method registry: every method's request and
//! answer schema comes from its Rust types (schemars), so the document cannot drift from what
//! the server parses and answers. Served at `GET /api/compute/openapi.json`; `vps openapi`
//! prints it.

use std::sync::LazyLock;

use axum::Json;
use schemars::generate::SchemaSettings;
use serde_json::{json, Map, Value};

use crate::error::ErrorBody;
use crate::methods::registry;
use crate::registry::Method;

/// Every error code with its HTTP status (SPEC §5).
const ERRORS: &[(&str, &str)] = &[
    ("400", "INVALID_INPUT"),
    ("401", "UNAUTHENTICATED"),
    ("403", "ACCESS_DENIED"),
    ("404", "NOT_FOUND"),
    ("409", "CONFLICT or INVALID_STATE"),
    ("422", "QUOTA_EXCEEDED"),
    ("429", "RATE_LIMITED"),
    ("500", "INTERNAL"),
    ("501", "UNSUPPORTED"),
    ("503", "CAPACITY_UNAVAILABLE"),
];

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
    for (status, _) in ERRORS {
        responses.insert(
            (*status).into(),
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
    let responses: Map<String, Value> = ERRORS
        .iter()
        .map(|(status, codes)| {
            let response = json!({
                "description": *codes,
                "content": { "application/json": { "schema": error } },
            });
            (format!("E{status}"), response)
        })
        .collect();
    Value::Object(responses)
}
