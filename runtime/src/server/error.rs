//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status. Every error a client receives is counted in
//! `thaw_request_failure_total{reason=code}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::metrics::METRICS;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub code: &'static str,
    pub param: Option<&'static str>,
    /// Seconds, for 429 and 503.
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, msg: String) -> ApiError {
        ApiError {
            status,
            message: msg,
            kind,
            code,
            param: None,
            retry_after: None,
        }
    }
    pub fn bad_request(msg: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            msg.into(),
        )
    }
    pub fn param(mut self, p: &'static str) -> ApiError {
        self.param = Some(p);
        self
    }
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            "a valid API key is required: send 'Authorization: Bearer <key>'".into(),
        )
    }
    pub fn forbidden(msg: &str) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "forbidden",
            msg.into(),
        )
    }
    pub fn model_not_found(name: &str, served: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model '{name}' does not exist; this worker serves '{served}'"),
        )
        .param("model")
    }
    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("no route for {path}"),
        )
    }
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body exceeds {limit} bytes"),
        )
    }
    pub fn context(msg: String) -> ApiError {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request_error",
            "context_length_exceeded",
            msg,
        )
    }
    pub fn overloaded(limit: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            format!("the worker is at capacity ({limit} requests in flight); retry later"),
        );
        e.retry_after = Some(1);
        e
    }
    pub fn unavailable(msg: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "unavailable",
            msg.into(),
        );
        e.retry_after = Some(1);
        e
    }
    pub fn internal(msg: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            msg.into(),
        )
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        METRICS.failure.with_label_values(&[self.code]).inc();
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
