//! Constrained decoding: a generation's output held to a JSON schema, any JSON object, a
//! regular expression or a Lark grammar ([`Constraint`]).
//!
//! Each step, the tokens that can continue the output within the constraint are computed on
//! the host by [llguidance](https://github.com/guidance-ai/llguidance) (an Earley parser over
//! the token trie, the engine behind llama.cpp's, vLLM's and mistral.rs's structured output),
//! the others' logits are set to -inf on the device, and the row's sampler then picks as it
//! would have: greedy, drawn, filtered or penalized alike. The chosen token advances the
//! parser. The end-of-sequence tokens are allowed exactly where the output is complete, so a
//! constrained generation ends with a complete value, unless `max_tokens` cuts it first.
//!
//! A constrained row reads its mask from the host before each step, so it does not decode one
//! step ahead ([`crate::GenOptions::lookahead`]); the rows around it in a batch lose their
//! run ahead too while it is live.

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use tokenizers::Tokenizer;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::{Error, Result};

/// What a generation's output must match ([`crate::GenOptions::constraint`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Constraint {
    /// A JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value valid under this JSON schema (draft 2020-12, the subset llguidance supports;
    /// an `x-guidance` key may set its options, such as `{"whitespace_flexible": false}` for
    /// compact output).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Constraint {
    /// The constraint as text, for recognising it again.
    fn key(&self) -> String {
        match self {
            Constraint::JsonObject => "object".into(),
            Constraint::JsonSchema(schema) => format!("schema {schema}"),
            Constraint::Regex(rx) => format!("regex {rx}"),
            Constraint::Lark(g) => format!("lark {g}"),
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// Compiles constraints over one tokenizer's tokens: the token trie (built once, a moment for
/// a 262,144-token vocabulary) shared by every constrained generation it starts.
pub struct ConstraintCompiler {
    factory: ParserFactory,
    vocab: usize,
    /// Fresh parsers of the constraints started lately, by [`Constraint::key`], the latest
    /// last: a constraint seen before starts as a copy instead of compiling again (a server's
    /// requests often share one schema or tool list, and it checks each before queueing).
    started: Mutex<Vec<(String, Matcher)>>,
}

/// Fresh parsers a [`ConstraintCompiler`] keeps for constraints started again.
const STARTED_KEPT: usize = 32;

impl std::fmt::Debug for ConstraintCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintCompiler")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl ConstraintCompiler {
    /// The compiler over `tokenizer`'s tokens, with `eos` (those below `vocab`; the tokenizer's
    /// `<eos>` where none are) ending a complete output, and masks `vocab` wide (the logits'
    /// width).
    ///
    /// # Errors
    /// [`Error::Constraint`] for a tokenizer whose tokens are not SentencePiece-style pieces
    /// with byte fallback (Gemma's), or without an end-of-sequence token in the vocabulary.
    pub fn new(tokenizer: &Tokenizer, eos: &[u32], vocab: usize) -> Result<Self> {
        let factory = factory(tokenizer, eos, vocab).map_err(Error::Constraint)?;
        Ok(Self {
            factory,
            vocab,
            started: Mutex::new(Vec::new()),
        })
    }

    /// The running form of `constraint` for one generation.
    ///
    /// # Errors
    /// [`Error::Constraint`] for a constraint that does not compile (an unsupported schema
    /// keyword, a malformed pattern or grammar).
    pub fn start(&self, constraint: &Constraint) -> Result<TokenConstraint> {
        let key = constraint.key();
        // A poisoned lock only means another start panicked; the list is still whole.
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        let matcher = match started.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let kept = started.remove(i);
                let copy = kept.1.deep_clone();
                started.push(kept);
                copy
            }
            None => {
                drop(started);
                let parser = self
                    .factory
                    .create_parser(constraint.grammar())
                    .map_err(|e| Error::Constraint(e.to_string()))?;
                let matcher = Matcher::new(Ok(parser));
                if let Some(e) = matcher.get_error() {
                    return Err(Error::Constraint(e));
                }
                let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
                // Another start of the same constraint may have kept it meanwhile.
                if !started.iter().any(|(k, _)| *k == key) {
                    if started.len() >= STARTED_KEPT {
                        started.remove(0);
                    }
                    started.push((key, matcher.deep_clone()));
                }
                matcher
            }
        };
        Ok(TokenConstraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// A model's [`ConstraintCompiler`], built on its first constrained generation.
#[derive(Debug, Default)]
pub(crate) struct Grammars(OnceLock<std::result::Result<Arc<ConstraintCompiler>, String>>);

impl Grammars {
    /// [`ConstraintCompiler::start`] on the model's compiler, built first where this is the
    /// first call (over `tokenizer`, with `eos` and `vocab` as [`ConstraintCompiler::new`]).
    ///
    /// # Errors
    /// [`Error::Constraint`] without a tokenizer, and as [`ConstraintCompiler::new`] and
    /// [`ConstraintCompiler::start`].
    pub(crate) fn start(
        &self,
        constraint: &Constraint,
        tokenizer: Option<&Tokenizer>,
        eos: &[u32],
        vocab: usize,
    ) -> Result<TokenConstraint> {
        let compiler = self
            .0
            .get_or_init(|| {
                let tokenizer = tokenizer.ok_or("the checkpoint has no tokenizer.json")?;
                ConstraintCompiler::new(tokenizer, eos, vocab)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Constraint(e.clone()))?;
        compiler.start(constraint)
    }
}

/// One generation's constraint as it runs: the parser's state after the tokens so far. For
/// callers that run their own decoding loop over [`crate::Model::forward`]: ask
/// [`TokenConstraint::allowed`] before each pick and give the pick to
/// [`TokenConstraint::accept`]. Made by [`crate::Model::constraint`] or
/// [`ConstraintCompiler::start`].
pub struct TokenConstraint {
    matcher: Matcher,
    vocab: usize,
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("vocab", &self.vocab)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl TokenConstraint {
    /// The tokens that may come next, one byte a token of the logits' width (1 allowed).
    ///
    /// # Errors
    /// [`Error::Constraint`] where the parser failed, or where no token can continue (a
    /// grammar the vocabulary cannot spell).
    pub fn allowed(&mut self) -> Result<Vec<u8>> {
        let mut mask = vec![0u8; self.vocab];
        self.allowed_into(&mut mask)?;
        Ok(mask)
    }

    /// [`Self::allowed`] written into `mask` (the logits' width; every byte is set).
    fn allowed_into(&mut self, mask: &mut [u8]) -> Result<()> {
        if mask.len() != self.vocab {
            return Err(Error::Input(format!(
                "a constraint over {} tokens for logits of {}",
                self.vocab,
                mask.len()
            )));
        }
        let mut bits = vec![0u32; self.vocab.div_ceil(32)];
        self.allowed_bits_into(&mut bits)?;
        bits_to_bytes(&bits, mask);
        Ok(())
    }

    /// [`Self::allowed`] as bits: bit `t % 32` of `words[t / 32]` for token `t`, `words` one
    /// word for every 32 tokens of the logits' width (bits past it clear).
    pub(crate) fn allowed_bits_into(&mut self, words: &mut [u32]) -> Result<()> {
        let want = self.vocab.div_ceil(32);
        if words.len() != want {
            return Err(Error::Input(format!(
                "{} mask words for a constraint over {} tokens",
                words.len(),
                self.vocab
            )));
        }
        let set = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| Error::Constraint(e.to_string()))?;
        // The parser's bits (its vocabulary may be wider or narrower than the logits).
        let src = set.as_slice();
        let n = src.len().min(want);
        words[..n].copy_from_slice(&src[..n]);
        words[n..].fill(0);
        if !self.vocab.is_multiple_of(32) {
            words[want - 1] &= (1u32 << (self.vocab % 32)) - 1;
        }
        if words.iter().all(|&w| w == 0) {
            return Err(Error::Constraint(
                "no token of the vocabulary can continue the output".to_string(),
            ));
        }
        Ok(())
    }

    /// Advances the parser past `token`, the one chosen from [`Self::allowed`].
    ///
    /// # Errors
    /// [`Error::Constraint`] for a token the constraint does not allow here.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        // A complete output allows only the end-of-sequence tokens, which end the generation
        // (or, past `ignore_eos`, leave nothing more to parse).
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::Constraint(format!("token {token}: {e}")))
    }
}

/// `bytes[t]` = bit `t % 32` of `words[t / 32]`: a mask of bits as a byte a token.
pub(crate) fn bits_to_bytes(words: &[u32], bytes: &mut [u8]) {
    for (t, b) in bytes.iter_mut().enumerate() {
        *b = ((words[t / 32] >> (t % 32)) & 1) as u8;
    }
}

/// The grammar compiler over `tokenizer`'s tokens, with `eos` (those below `vocab`; the
/// tokenizer's `<eos>` where none are) ending complete outputs.
fn factory(
    tokenizer: &Tokenizer,
    eos: &[u32],
    vocab: usize,
) -> std::result::Result<ParserFactory, String> {
    let words = token_bytes(tokenizer, vocab)?;
    let vocab_u32 = u32::try_from(vocab).map_err(|_| format!("a vocabulary of {vocab}"))?;
    let mut ends: Vec<u32> = eos.iter().copied().filter(|&t| t < vocab_u32).collect();
    if ends.is_empty() {
        ends.extend(tokenizer.token_to_id("<eos>").filter(|&t| t < vocab_u32));
    }
    let first = *ends
        .first()
        .ok_or("no end-of-sequence token within the vocabulary")?;
    let info = TokRxInfo::new(vocab_u32, first);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&ends);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// Each token's bytes, `vocab` of them (ids the tokenizer lacks get none): `<0xHH>` pieces
/// their byte, special tokens the trie's marker and their name, other pieces their text with
/// `▁` as a space.
fn token_bytes(tokenizer: &Tokenizer, vocab: usize) -> std::result::Result<Vec<Vec<u8>>, String> {
    let decoder = tokenizer
        .get_decoder()
        .map(|d| serde_json::to_string(d).unwrap_or_default())
        .unwrap_or_default();
    if !decoder.contains("ByteFallback") {
        return Err(
            "constraints need a tokenizer of SentencePiece pieces with byte fallback (Gemma's)"
                .to_string(),
        );
    }
    let special: std::collections::HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect();
    let mut words = vec![Vec::new(); vocab];
    for (piece, id) in tokenizer.get_vocab(true) {
        let Some(slot) = words.get_mut(id as usize) else {
            continue;
        };
        *slot = if special.contains(&id) {
            let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            b.extend_from_slice(piece.as_bytes());
            b
        } else if let Some(byte) = byte_piece(&piece) {
            vec![byte]
        } else {
            piece.replace('▁', " ").into_bytes()
        };
    }
    Ok(words)
}

/// The byte of a byte-fallback piece (`<0x0A>`).
fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_pieces_are_their_byte_and_nothing_else() {
        assert_eq!(byte_piece("<0x0A>"), Some(10));
        assert_eq!(byte_piece("<0xff>"), Some(255));
        assert_eq!(byte_piece("<0x0>"), None);
        assert_eq!(byte_piece("<0xZZ>"), None);
        assert_eq!(byte_piece("<0x0AB>"), None);
        assert_eq!(byte_piece("0x0A"), None);
    }
}
