//! A multi-turn chat over one [`Generator`]: renders each turn with the checkpoint's template,
//! streams the answer as parsed events (thinking, text, tool calls), and keeps the exact token
//! history so that each new turn prefills only its own tokens.
//!
//! History choice: the cache holds the conversation *as the model produced it* (its thinking
//! included). Re-rendering earlier turns through the template would strip that thinking and
//! force a re-prefill of every earlier answer; call [`ChatSession::rebuild_from_template`] to
//! get the template's exact rendering at that cost.

use super::parser::{OutputEvent, OutputParser};
use super::template::{ChatTemplate, Message, RenderOptions, ToolCall};
use crate::error::{Error, Result};
use crate::generate::{FinishReason, GenOptions, Generator, Stats};
use crate::model::Model;

/// The text of the token that ends a model turn.
const END_OF_TURN: &str = "<turn|>";

/// Special tokens the output parser needs to see; every other special token (`<unused…>`,
/// `<mask>`, image placeholders, ...) is dropped from the stream before parsing.
const STRUCTURAL: &[&str] = &[
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|\"|>",
    "<|turn>",
    "<turn|>",
    "<|tool_response>",
    "<tool_response|>",
];

/// The ids of the special tokens dropped from a streamed answer before it is parsed: every
/// special token of the model's tokenizer but the structural ones the output parser reads
/// (channel, tool-call, turn markers). Empty without a tokenizer.
pub fn hidden_token_ids(model: &Model) -> std::collections::HashSet<u32> {
    model
        .tokenizer()
        .map(|t| {
            t.get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, tok)| tok.special && !STRUCTURAL.contains(&tok.content.as_str()))
                .map(|(id, _)| id)
                .collect()
        })
        .unwrap_or_default()
}

/// One answer of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The answer text (no special tokens, no thinking).
    pub text: String,
    /// The thinking, when the model thought.
    pub thinking: String,
    /// Tool calls the model made.
    pub tool_calls: Vec<ToolCall>,
    /// Why the answer ended (`None` when the caller stopped it).
    pub finish: Option<FinishReason>,
    /// Counters of this turn (`prefilled_tokens` says how much of the prompt was new).
    pub stats: Stats,
}

/// A conversation with a model.
#[derive(Debug)]
pub struct ChatSession<'m> {
    model: &'m Model,
    generator: Generator<'m>,
    template: ChatTemplate,
    render: RenderOptions,
    messages: Vec<Message>,
    /// Every token the model has seen or produced, in order (the next prompt extends it).
    history: Vec<u32>,
}

impl<'m> ChatSession<'m> {
    /// Starts a chat with the checkpoint's own template (or the built-in Gemma 4 one).
    /// Special tokens are kept in the stream so the parser can split thinking and tool calls.
    ///
    /// # Errors
    /// An invalid template in the checkpoint.
    pub fn new(model: &'m Model, mut options: GenOptions) -> Result<Self> {
        options.skip_special_tokens = false;
        Ok(Self {
            model,
            generator: model.generator(options),
            template: ChatTemplate::from_checkpoint_dir(model.dir())?,
            render: RenderOptions::default(),
            messages: Vec::new(),
            history: Vec::new(),
        })
    }

    /// Uses this template instead of the checkpoint's.
    pub fn with_template(mut self, template: ChatTemplate) -> Self {
        self.template = template;
        self
    }

    /// Sets the system message (before the first turn).
    pub fn with_system(mut self, text: impl Into<String>) -> Self {
        self.messages.retain(|m| m.role != super::Role::System);
        self.messages.insert(0, Message::system(text));
        self
    }

    /// Turns thinking on or off (before the first turn).
    pub fn with_thinking(mut self, on: bool) -> Self {
        self.render.enable_thinking = on;
        self
    }

    /// Declares tools (JSON schemas) the model may call (before the first turn).
    pub fn with_tools(mut self, tools: Vec<serde_json::Value>) -> Self {
        self.render.tools = tools;
        self
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Every token of the conversation so far: each prompt and each generated token.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The generator (for its cache and options).
    pub fn generator_mut(&mut self) -> &mut Generator<'m> {
        &mut self.generator
    }

    /// Re-renders the whole conversation through the template on the next turn (the cache
    /// reuses the longest common prefix).
    pub fn rebuild_from_template(&mut self) {
        self.history.clear();
    }

    /// The prompt tokens of the next turn, given the conversation with the new message.
    fn next_prompt(&self) -> Result<Vec<u32>> {
        let full = self.template.render(&self.messages, &self.render)?;
        if self.history.is_empty() {
            return self.model.encode(&full, false);
        }
        // Everything up to the previous answer is already in `history`; render the previous
        // conversation to find where the new text starts.
        let previous = &self.messages[..self.messages.len() - 1];
        let closed = self.template.render(
            previous,
            &RenderOptions {
                add_generation_prompt: false,
                ..self.render.clone()
            },
        )?;
        let Some(delta) = full.strip_prefix(&closed) else {
            return self.model.encode(&full, false);
        };
        // The text the template puts after the answer's `<turn|>` (a newline) is not in the
        // history yet; nor is `<turn|>` itself when the answer was cut short.
        let after_eot = closed
            .rfind(END_OF_TURN)
            .map_or("", |i| &closed[i + END_OF_TURN.len()..]);
        let eot_id = self
            .model
            .tokenizer()
            .and_then(|t| t.token_to_id(END_OF_TURN));
        let closed_by_model = eot_id.is_some() && self.history.last().copied() == eot_id;
        let mut text = String::new();
        if !closed_by_model {
            text.push_str(END_OF_TURN);
        }
        text.push_str(after_eot);
        text.push_str(delta);
        let mut tokens = self.history.clone();
        tokens.extend(self.model.encode(&text, false)?);
        Ok(tokens)
    }

    /// Sends a user message and streams the answer: `on_event` sees each parsed piece as it is
    /// made and returns `false` to stop the answer early (the conversation stays usable).
    ///
    /// # Errors
    /// Template, tokenizer, model or cache errors.
    pub fn send(
        &mut self,
        user: impl Into<String>,
        mut on_event: impl FnMut(&OutputEvent) -> bool,
    ) -> Result<Reply> {
        if self.model.tokenizer().is_none() {
            return Err(Error::Tokenizer(format!(
                "chat needs a tokenizer.json in {}",
                self.model.dir().display()
            )));
        }
        self.messages.push(Message::user(user));
        let prompt = match self.next_prompt() {
            Ok(p) => p,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        let mut parser = OutputParser::new();
        let mut reply = Reply {
            text: String::new(),
            thinking: String::new(),
            tool_calls: Vec::new(),
            finish: None,
            stats: Stats::default(),
        };
        let mut generated = Vec::new();
        let mut absorb = |events: Vec<OutputEvent>, reply: &mut Reply| -> bool {
            let mut keep_going = true;
            for ev in events {
                match &ev {
                    OutputEvent::Thinking(t) => reply.thinking.push_str(t),
                    OutputEvent::Text(t) => reply.text.push_str(t),
                    OutputEvent::ToolCall { name, arguments } => reply.tool_calls.push(ToolCall {
                        id: None,
                        name: name.clone(),
                        arguments: arguments.clone(),
                    }),
                }
                keep_going &= on_event(&ev);
            }
            keep_going
        };
        let hidden = hidden_token_ids(self.model);
        let mut stream = self.generator.stream(&prompt)?;
        for step in stream.by_ref() {
            let step = step?;
            generated.push(step.token);
            reply.finish = step.finish;
            let text = if hidden.contains(&step.token) {
                ""
            } else {
                step.text.as_str()
            };
            if !absorb(parser.push(text), &mut reply) {
                break;
            }
        }
        reply.stats = stream.stats();
        drop(stream);
        absorb(parser.finish(), &mut reply);
        self.history = prompt;
        self.history.extend(&generated);
        let mut answer = Message::assistant(reply.text.clone());
        if !reply.thinking.is_empty() {
            answer = answer.with_reasoning(reply.thinking.clone());
        }
        for call in &reply.tool_calls {
            answer = answer.with_tool_call(call.name.clone(), call.arguments.clone());
        }
        self.messages.push(answer);
        Ok(reply)
    }
}
