//! The API's one error type: a SPEC code, an HTTP status, a message and details. Internal
//! failures are logged with their chain and answered as `INTERNAL`, without SQL or paths.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{json, Value};
use vps_commands::CommandError;
use vps_domain::DomainError;

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    /// `INVALID_INPUT`, `NOT_FOUND`, …
    pub code: &'static str,
    /// For people.
    pub message: String,
    /// For programs.
    pub details: Value,
}

impl ApiError {
    /// `INVALID_INPUT` naming a field.
    pub fn invalid(field: &str, message: impl Into<String>) -> ApiError {
        let message = message.into();
        ApiError {
            code: "INVALID_INPUT",
            message: format!("{field}: {message}"),
            details: json!({ "field": field }),
        }
    }

    /// Any code with a message.
    pub fn new(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            details: json!({}),
        }
    }

    /// The HTTP status of the code (SPEC §5).
    pub fn status(&self) -> StatusCode {
        match self.code {
            "INVALID_INPUT" => StatusCode::BAD_REQUEST,
            "UNAUTHENTICATED" => StatusCode::UNAUTHORIZED,
            "ACCESS_DENIED" => StatusCode::FORBIDDEN,
            "NOT_FOUND" => StatusCode::NOT_FOUND,
            "CONFLICT" | "INVALID_STATE" => StatusCode::CONFLICT,
            "QUOTA_EXCEEDED" => StatusCode::UNPROCESSABLE_ENTITY,
            "CAPACITY_UNAVAILABLE" => StatusCode::SERVICE_UNAVAILABLE,
            "SPEND_LIMIT_REACHED" => StatusCode::PAYMENT_REQUIRED,
            "UNSUPPORTED" => StatusCode::NOT_IMPLEMENTED,
            "RATE_LIMITED" => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<DomainError> for ApiError {
    fn from(e: DomainError) -> Self {
        ApiError {
            code: e.code(),
            message: e.to_string(),
            details: e.details(),
        }
    }
}

impl From<CommandError> for ApiError {
    fn from(e: CommandError) -> Self {
        match e {
            CommandError::Domain(d) => d.into(),
            CommandError::Contention(what) => ApiError::new(
                "CONFLICT",
                format!("{what} is changing too fast; try again"),
            ),
            other => internal(&other),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        internal(&e)
    }
}

/// `INTERNAL`, with the error's chain logged (never shown).
pub fn internal(e: &dyn std::error::Error) -> ApiError {
    let mut chain = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    tracing::error!(error = %chain, "internal error");
    ApiError::new("INTERNAL", "internal error; see the server log")
}

/// The body of an error answer, as the OpenAPI document describes it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorBody {
    /// The SPEC's code.
    #[schemars(with = "ErrorCode")]
    pub code: &'static str,
    /// For people.
    pub message: String,
    /// For programs: `field` for `INVALID_INPUT`; `resource, requested, max, used` for
    /// `QUOTA_EXCEEDED`; the existing id for `CONFLICT`.
    #[schemars(with = "serde_json::Map<String, Value>")]
    pub details: Value,
}

/// Every code an error answer can carry.
#[allow(dead_code)] // Only its schema is used.
#[derive(JsonSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
enum ErrorCode {
    InvalidInput,
    Unauthenticated,
    AccessDenied,
    NotFound,
    Conflict,
    InvalidState,
    QuotaExceeded,
    CapacityUnavailable,
    SpendLimitReached,
    Unsupported,
    RateLimited,
    Internal,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = ErrorBody {
            code: self.code,
            message: self.message,
            details: self.details,
        };
        (status, Json(body)).into_response()
    }
}
