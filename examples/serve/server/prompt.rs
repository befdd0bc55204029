//! Chat prompt rendering: a conversation (already converted from the OpenAI or Anthropic
//! shape into the library's [`Message`]s) through the checkpoint's chat template, then the
//! tokenizer.
//!
//! The template is the checkpoint's own (`chat_template.jinja` or `tokenizer_config.json`)
//! or the crate's built-in Gemma 4 template, loaded once at start. The rendered prompt starts
//! with its `<bos>`, so it is encoded without adding one.

use candle_gemma::chat::{ChatTemplate, Message, RenderOptions};
use candle_gemma::Model;
use serde_json::Value;

use super::error::ApiError;

/// Renders conversations for one model.
#[derive(Debug, Clone)]
pub struct PromptRenderer {
    template: ChatTemplate,
}

impl PromptRenderer {
    /// The model's template (the built-in one for a model without a folder).
    pub fn for_model(model: &Model) -> anyhow::Result<Self> {
        let template = if model.dir().as_os_str().is_empty() {
            ChatTemplate::builtin()
        } else {
            ChatTemplate::from_checkpoint_dir(model.dir())?
        };
        Ok(Self { template })
    }

    /// The prompt tokens of `messages`, ending with the opening of a model turn.
    ///
    /// # Errors
    /// 400 when the model has no tokenizer, the conversation is empty or the template
    /// rejects it (a bad tool declaration, a `raise_exception` of the template).
    pub fn tokens(
        &self,
        model: &Model,
        messages: &[Message],
        tools: Vec<Value>,
        enable_thinking: bool,
    ) -> Result<Vec<u32>, ApiError> {
        if model.tokenizer().is_none() {
            return Err(ApiError::unsupported(
                "messages",
                "this model has no tokenizer (random weights?): use /v1/completions with token ids",
            ));
        }
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let options = RenderOptions {
            enable_thinking,
            tools,
            ..RenderOptions::default()
        };
        let text = self
            .template
            .render(messages, &options)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        model
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))
    }
}
