//! API-key check of the `/v1` routes: with `--api-key KEY`, every request must carry
//! `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`); otherwise a 401 with an
//! error object. The comparison does not stop at the first differing byte.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::AppState;

/// Passes the request on when no key is set or the right key is given.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    match &state.config.api_key {
        Some(key) if !authorized(request.headers(), key) => {
            ApiError::unauthorized().into_response()
        }
        _ => next.run(request).await,
    }
}

fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    [bearer, x_api_key]
        .into_iter()
        .flatten()
        .any(|given| same(given.trim().as_bytes(), key.as_bytes()))
}

/// Equality whose time does not depend on where the inputs first differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
