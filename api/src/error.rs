//! The API's one error type: a SPEC code, an HTTP status, a message and details. Internal
//! failures are logged with their chain and answered as `INTERNAL`, without SQL or paths.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{json, Value};
use vps_commands::CommandError;
use vps_domain::{DomainError, ErrorCode};

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    /// `INVALID_INPUT`, `NOT_FOUND`, …
    pub code: ErrorCode,
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
            code: ErrorCode::InvalidInput,
            message: format!("{field}: {message}"),
            details: json!({ "field": field }),
        }
    }

    /// Any code with a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            details: json!({}),
        }
    }

    /// The HTTP status of the code (SPEC §5).
    pub fn status(&self) -> StatusCode {
        status(self.code)
    }
}

/// The HTTP status of each code (SPEC §5): the one place that decides it; the OpenAPI
/// document's error responses are built from it.
pub fn status(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::InvalidInput => StatusCode::BAD_REQUEST,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::AccessDenied => StatusCode::FORBIDDEN,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::Conflict | ErrorCode::InvalidState => StatusCode::CONFLICT,
        ErrorCode::QuotaExceeded => StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::CapacityUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Unsupported => StatusCode::NOT_IMPLEMENTED,
        ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
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
                ErrorCode::Conflict,
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
    ApiError::new(ErrorCode::Internal, "internal error; see the server log")
}

/// The body of an error answer, as the OpenAPI document describes it.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorBody {
    /// The SPEC's code.
    pub code: ErrorCode,
    /// For people.
    pub message: String,
    /// For programs: `field` for `INVALID_INPUT`; `resource, requested, max, used` for
    /// `QUOTA_EXCEEDED`; the existing id for `CONFLICT`.
    #[schemars(with = "serde_json::Map<String, Value>")]
    pub details: Value,
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
