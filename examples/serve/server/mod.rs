//! An OpenAI- and Anthropic-compatible HTTP server over the library's serving engine.
//!
//! Routes (`/v1/*` require `Authorization: Bearer KEY` when an API key is set; `/health`
//! never does):
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/chat/completions` | OpenAI chat, streaming or not, with tools and reasoning |
//! | `POST /v1/completions` | OpenAI completions; `prompt` as a string or as token ids |
//! | `POST /v1/messages` | Anthropic Messages: text, thinking, tool use, streaming events |
//! | `GET /v1/models` | the one served model |
//! | `GET /health` | 200 while the server runs, with the engine's load |
//!
//! Request fields beyond OpenAI's follow vLLM (`top_k`, `min_p`, `repetition_penalty`,
//! `ignore_eos`, `return_token_ids`, `chat_template_kwargs.enable_thinking`), plus `kv_bits`
//! (4, 8 or null) and `kv_group_size`, see [`options`]. Errors are OpenAI's error object
//! ([`error`]); a full queue is a 429 with `Retry-After`. Bodies are strict JSON: an invalid
//! escape such as `\s` is a 400 `invalid_json` giving its line and column ([`body`]).
//! A client that disconnects cancels its sequence: the response stream owns the request's
//! [`engine::Submission`], whose drop cancels it in the engine.
//!
//! Files: [`mod@engine`] (the only code that touches the library's engine), [`openai`] and
//! [`anthropic`] (wire types and response builders), [`chat`], [`completions`] and
//! [`messages`] (the route handlers), [`split`] (thinking and tool calls out of the token
//! stream), [`prompt`] (chat template), [`sse`] (event streams), [`auth`], [`body`],
//! [`error`], [`options`], [`structured`] (`response_format` and the guided fields).

pub mod anthropic;
pub mod auth;
pub mod body;
pub mod chat;
pub mod completions;
pub mod engine;
pub mod error;
pub mod logprobs;
pub mod messages;
pub mod openai;
pub mod options;
pub mod prompt;
pub mod split;
pub mod sse;
pub mod structured;
pub mod unimplemented;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_gemma::Model;
use serde_json::json;
use tokio::net::TcpListener;

use engine::{EngineHandle, EngineSettings, Served};
use error::ApiError;
use options::Defaults;
use prompt::PromptRenderer;

/// Largest request body, bytes.
const BODY_LIMIT: usize = 32 << 20;

/// What the server is told at start.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Names a request's `model` may use; the first is the one reported.
    pub model_names: Vec<String>,
    /// The key `/v1` routes require, if any.
    pub api_key: Option<String>,
    /// Defaults for fields a request leaves out.
    pub defaults: Defaults,
    /// The engine's batch, memory and queue settings.
    pub engine: EngineSettings,
}

/// State shared by every route.
#[derive(Debug)]
pub struct AppState {
    /// The start configuration.
    pub config: ServerConfig,
    /// The serving engine.
    pub engine: EngineHandle,
    /// The chat template.
    pub renderer: PromptRenderer,
    /// Special-token ids dropped from chat output before parsing.
    pub hidden: Arc<HashSet<u32>>,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
}

impl AppState {
    /// Builds the state and starts the engine.
    ///
    /// # Errors
    /// An unreadable chat template; the engine cannot start.
    pub fn new(served: Served, config: ServerConfig) -> anyhow::Result<Self> {
        let renderer = PromptRenderer::for_model(served.model())?;
        let hidden = Arc::new(candle_gemma::chat::hidden_token_ids(served.model()));
        let engine = EngineHandle::start(served, config.engine.clone())?;
        Ok(Self {
            config,
            engine,
            renderer,
            hidden,
            started: unix_now(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        self.engine.model()
    }

    /// The reported model id.
    pub fn model_id(&self) -> &str {
        self.config
            .model_names
            .first()
            .map_or("model", String::as_str)
    }

    /// A chat request's prompt, `messages` rendered with `tools` (and `thinking`), and its
    /// generation options: `knobs` at the prompt's length, the output held to the calls
    /// `forced` asks for or to the structured output the knobs ask for, and special tokens kept
    /// for the output split (which drops the others by id).
    ///
    /// # Errors
    /// A 400 from the knobs, the template or the constraint.
    pub fn chat_request(
        &self,
        knobs: &options::Knobs,
        messages: &[candle_gemma::chat::Message],
        tools: Vec<serde_json::Value>,
        forced: Option<&candle_gemma::chat::ForcedToolCall>,
        thinking: bool,
    ) -> Result<(Vec<u32>, candle_gemma::GenOptions), ApiError> {
        let prompt = self
            .renderer
            .tokens(self.model(), messages, tools.clone(), thinking)?;
        let mut options = knobs.to_options(&self.config.defaults, prompt.len(), self.context())?;
        structured::constrain(self.model(), &tools, forced, thinking, &mut options)?;
        options.skip_special_tokens = false;
        Ok((prompt, options))
    }

    /// Checks a request's `model` field (absent is fine).
    ///
    /// # Errors
    /// 400 `model_not_found` for a name this server does not serve.
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(m) if !self.config.model_names.iter().any(|n| n == m) => {
                Err(ApiError::unknown_model(m, self.model_id()))
            }
            _ => Ok(()),
        }
    }

    /// The model's context length, tokens.
    pub fn context(&self) -> usize {
        self.model().config().max_position_embeddings
    }
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(chat::handle))
        .route("/completions", post(completions::handle))
        .route("/messages", post(messages::handle))
        .route("/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    Router::new()
        .nest("/v1", v1)
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

/// 200 with the engine's load: queued and running requests, live KV bytes, prefix store.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let s = state.engine.stats();
    Json(json!({
        "status": "ok",
        "queued": s.queued,
        "running": s.running,
        "kv_bytes": s.kv_bytes,
        "prefix_bytes": s.prefix_bytes,
        "prefix_entries": s.prefix_entries,
    }))
    .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id(),
            "object": "model",
            "created": state.started,
            "owned_by": "candle-gemma",
            "max_model_len": state.context(),
        }]
    }))
    .into_response()
}

async fn not_found(uri: Uri) -> Response {
    ApiError::not_found(uri.path()).into_response()
}

/// A running server: its address and state. Dropping it stops the server and the engine.
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state (the engine's stats are read from here).
    pub state: Arc<AppState>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The base URL, `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
        self.state.engine.shutdown();
    }
}

/// Starts serving `served` (one model, or one sharded over several devices) on `listener`
/// (inside a tokio runtime).
///
/// # Errors
/// The state cannot be built (see [`AppState::new`]) or the listener has no address.
pub fn start(
    served: Served,
    config: ServerConfig,
    listener: TcpListener,
) -> anyhow::Result<Running> {
    let addr = listener.local_addr()?;
    let state = Arc::new(AppState::new(served, config)?);
    let app = router(state.clone());
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("serve: {e}");
        }
    });
    Ok(Running { addr, state, task })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh id with `prefix` (`chatcmpl-`, `call_`, `msg_`, ...), unique within the process.
pub fn new_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:x}{n:06x}", unix_now())
}
