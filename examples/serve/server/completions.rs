//! `POST /v1/completions`: a text prompt (encoded with `<bos>` first) or token ids (used as
//! given, the load generator's way) into the engine; the text back whole or as
//! `text_completion` chunks, one per generated token, ending with `data: [DONE]`. A model
//! without a tokenizer (`--random-weights`) returns `token_ids` whether asked or not. `n`
//! choices decode side by side, each with the seed moved by its index.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use candle_gemma::generate::TokenLogprobs;

use super::engine::{collect_all, Collected, Event};
use super::error::ApiError;
use super::logprobs;
use super::openai::{self, CompletionRequest, Prompt};
use super::sse::{self, Frame, Translate};
use super::{body, new_id, unix_now, AppState};

/// The route handler.
pub async fn handle(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = body::parse(body)?;
    state.check_model(req.model.as_deref())?;
    req.knobs
        .to_options(&state.config.defaults, 0, state.context())?;
    let prompt = match openai::prompt(req.prompt.as_ref())? {
        Prompt::Text(text) => {
            if state.model().tokenizer().is_none() {
                return Err(ApiError::unsupported(
                    "prompt",
                    "this model has no tokenizer (random weights?): send token ids",
                ));
            }
            state
                .model()
                .encode(&text, true)
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
        }
        Prompt::Ids(ids) => {
            let vocab = state.model().config().vocab_size;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            ids
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let options = req
        .knobs
        .to_options(&state.config.defaults, prompt.len(), state.context())?;
    super::structured::check(state.model(), &options)?;
    let stream = CompletionStream {
        state: state.clone(),
        offset: 0,
        id: new_id("cmpl-"),
        created: unix_now(),
        model: state.model_id().to_string(),
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        // Without a tokenizer the text is empty: the ids are all a client can read.
        return_ids: req.knobs.return_token_ids || state.model().tokenizer().is_none(),
    };
    let submissions = state
        .engine
        .submit_choices(&prompt, &options, req.knobs.choices())?;
    if req.stream {
        let streams = submissions.into_iter().map(|s| (s, stream.clone()));
        return Ok(sse::respond_choices(streams.collect()));
    }
    let done = collect_all(submissions).await?;
    let response = openai::choices_answer(
        &done,
        |i, d| choice(&state, stream.return_ids, i, d),
        |choices| stream.envelope(choices),
    );
    Ok(Json(response).into_response())
}

/// Choice `index` of a finished completion.
fn choice(state: &AppState, return_ids: bool, index: usize, done: &Collected) -> Value {
    let text: String = done.steps.iter().map(|s| s.text.as_str()).collect();
    let mut offset = 0;
    let listed: Vec<(u32, &TokenLogprobs, usize)> = done
        .steps
        .iter()
        .filter_map(|s| {
            let at = offset;
            offset += s.text.len();
            s.logprobs.as_ref().map(|lp| (s.token, lp, at))
        })
        .collect();
    let logprobs = if listed.is_empty() {
        Value::Null
    } else {
        logprobs::completion_lists(state.model(), &listed)
    };
    let mut choice = json!({
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": openai::finish_reason(done.finish, false),
    });
    if return_ids {
        choice["token_ids"] = json!(done.steps.iter().map(|s| s.token).collect::<Vec<_>>());
    }
    choice
}

/// Translates one completion into `text_completion` chunks.
#[derive(Debug, Clone)]
pub struct CompletionStream {
    /// The server (the tokenizer names the tokens of log-probabilities).
    state: Arc<AppState>,
    /// Bytes of text streamed so far (each token's `text_offset`).
    offset: usize,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    return_ids: bool,
}

impl CompletionStream {
    fn envelope(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn chunk(&self, text: &str, ids: &[u32], finish: Option<&str>) -> Frame {
        self.chunk_with(text, ids, finish, Value::Null)
    }

    fn chunk_with(&self, text: &str, ids: &[u32], finish: Option<&str>, lp: Value) -> Frame {
        let mut choice = json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish});
        if self.return_ids {
            choice["token_ids"] = json!(ids);
        }
        Frame::Data(self.envelope(json!([choice])))
    }
}

impl Translate for CompletionStream {
    fn event(&mut self, event: Event) -> (Vec<Frame>, bool) {
        match event {
            Event::Started { .. } => (Vec::new(), false),
            // One chunk per token, even an empty piece: clients time tokens by chunks.
            Event::Token(step) => {
                let lp = match &step.logprobs {
                    Some(lp) => logprobs::completion_lists(
                        self.state.model(),
                        &[(step.token, lp, self.offset)],
                    ),
                    None => Value::Null,
                };
                self.offset += step.text.len();
                let frame = self.chunk_with(&step.text, &[step.token], None, lp);
                (vec![frame], false)
            }
            Event::Done { finish, usage } => {
                let reason = openai::finish_reason(finish, false);
                let mut out = vec![self.chunk("", &[], Some(reason))];
                if self.include_usage {
                    let mut last = self.envelope(json!([]));
                    last["usage"] = openai::usage(&usage);
                    out.push(Frame::Data(last));
                }
                out.push(Frame::Done);
                (out, true)
            }
            Event::Failed(message) => (
                vec![Frame::Data(ApiError::internal(message).body()), Frame::Done],
                true,
            ),
        }
    }

    fn closed(&mut self) -> Vec<Frame> {
        vec![Frame::Data(ApiError::unavailable().body()), Frame::Done]
    }
}
