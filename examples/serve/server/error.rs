//! API errors: one type for every failure a route can return, written as OpenAI's error object.
//!
//! The body is `{"type": "error", "error": {"message", "type", "param", "code"}}`: OpenAI
//! clients read `error.message`, `error.type`, `error.param` and `error.code`; Anthropic
//! clients read the top-level `type: "error"` and `error.type` / `error.message`, so one shape
//! serves both APIs. 429 and 503 carry a `Retry-After` header (seconds).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A failed request: HTTP status plus OpenAI's error fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A human-readable message.
    pub message: String,
    /// The error class (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_kv_bits`, `queue_full`, ...).
    pub code: Option<String>,
    /// Seconds after which a retry may succeed (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    fn with(mut self, param: Option<&str>, code: &str) -> Self {
        self.param = param.map(str::to_string);
        self.code = Some(code.to_string());
        self
    }

    /// 400: a request field has a bad value; the code is `invalid_<param>`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            .with(Some(param), &format!("invalid_{param}"))
    }

    /// 400: a feature this server does not offer.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            .with(Some(param), "unsupported")
    }

    /// 400: the body is not valid JSON or does not have the request's shape.
    pub fn bad_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
            .with(None, "invalid_json")
    }

    /// 400: a required field is missing.
    pub fn missing(param: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("`{param}` is required"),
        )
        .with(Some(param), "missing_required_parameter")
    }

    /// 400: the request names a model this server does not serve.
    pub fn unknown_model(requested: &str, served: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("the model `{requested}` does not exist; this server serves `{served}`"),
        )
        .with(Some("model"), "model_not_found")
    }

    /// 400: the prompt does not fit the context.
    pub fn context_length(tokens: usize, limit: usize) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "the prompt has {tokens} tokens; this model's context is {limit} tokens \
                 (the prompt must leave room for one generated token)"
            ),
        )
        .with(Some("messages"), "context_length_exceeded")
    }

    /// 401: no API key, or the wrong one.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key: send `Authorization: Bearer KEY`",
        )
        .with(None, "invalid_api_key")
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {path}"),
        )
        .with(None, "not_found")
    }

    /// 429: the request queue is full.
    pub fn queue_full(retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the request queue is full; retry later",
        )
        .with(None, "queue_full");
        e.retry_after = Some(retry_after.max(1));
        e
    }

    /// 503: the engine is shutting down or stopped.
    pub fn unavailable() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the engine is not running",
        )
        .with(None, "engine_unavailable");
        e.retry_after = Some(1);
        e
    }

    /// 500: the engine failed while generating.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with(None, "engine_error")
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "type": "error",
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
