//! Streaming detokenization: turns generated token ids, one at a time, into text chunks.
//!
//! Decoding each token on its own is wrong twice over: a character outside ASCII may span
//! several byte-fallback tokens (`<0xE4>`, `<0xB8>`, `<0x96>` for "世"), and decoders such as
//! SentencePiece's strip or add spaces depending on the neighbouring tokens. So the decoder
//! keeps a short window of recent ids, decodes the window, and emits only the new suffix
//! once it ends in a complete character — the same scheme as `tokenizers`' `DecodeStream`.

use tokenizers::Tokenizer;

use crate::{Error, Result};

/// The replacement character a byte-fallback decoder produces for an incomplete sequence.
const REPLACEMENT: char = '\u{FFFD}';

/// Incremental detokenizer over a borrowed [`Tokenizer`].
///
/// Concatenating every `Some` returned by [`push`](Self::push) and the result of
/// [`finish`](Self::finish) gives the same text as decoding all the ids at once, and no
/// chunk ever ends inside a UTF-8 character.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    skip_special_tokens: bool,
    /// Context ids: `ids[..prefix_len]` were already emitted and decode to `prefix`;
    /// the rest are pending.
    ids: Vec<u32>,
    prefix: String,
    prefix_len: usize,
}

impl<'t> StreamDecoder<'t> {
    /// Creates a decoder; with `skip_special_tokens`, tokens such as `<turn|>` decode to
    /// nothing (as in `Tokenizer::decode`).
    pub fn new(tokenizer: &'t Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_len: 0,
        }
    }

    /// Adds one token; returns the text it completes, if any.
    ///
    /// `None` means the token produced no complete character yet (a partial UTF-8
    /// sequence, or a skipped special token).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if decoding fails (e.g. an id outside the vocabulary in a
    /// tokenizer that rejects it).
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.decode(&self.ids)?;
        if text.len() <= self.prefix.len() || text.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        let new_text = self.new_suffix(&text)?;
        // The ids just emitted become the context for the next token.
        self.ids.drain(..self.prefix_len);
        self.prefix = self.decode(&self.ids)?;
        self.prefix_len = self.ids.len();
        Ok(Some(new_text))
    }

    /// Flushes whatever is pending (e.g. a trailing incomplete byte sequence, which decodes
    /// to U+FFFD) and resets the decoder.
    ///
    /// # Errors
    /// As for [`push`](Self::push).
    pub fn finish(&mut self) -> Result<Option<String>> {
        let text = self.decode(&self.ids)?;
        let out = if text.len() > self.prefix.len() {
            Some(self.new_suffix(&text)?)
        } else {
            None
        };
        self.ids.clear();
        self.prefix.clear();
        self.prefix_len = 0;
        Ok(out)
    }

    /// The text after what was already emitted. With malformed byte sequences a byte-fallback
    /// decoder can render the same ids differently once more ids follow (a lone `<0xE2>` becomes
    /// part of a different replacement run); emitted text cannot be taken back, so the new text
    /// then continues after the longest part both renderings share.
    fn new_suffix(&self, text: &str) -> Result<String> {
        if let Some(rest) = text.strip_prefix(self.prefix.as_str()) {
            return Ok(rest.to_string());
        }
        let shared: usize = text
            .char_indices()
            .zip(self.prefix.chars())
            .take_while(|((_, a), b)| a == b)
            .map(|((_, a), _)| a.len_utf8())
            .sum();
        Ok(text[shared..].to_string())
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence;
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::normalizers::replace::Replace;
    use tokenizers::{AddedToken, DecoderWrapper};

    /// A Gemma-like tokenizer: a few whole characters, every byte as `<0xNN>`, spaces as
    /// `▁`, and two special tokens.
    fn tokenizer() -> Tokenizer {
        let mut vocab = Vocab::default();
        for (i, t) in ["<unk>", "▁", "h", "é", "l", "o", "世"].iter().enumerate() {
            vocab.insert(t.to_string(), i as u32);
        }
        for b in 0..=255u32 {
            vocab.insert(format!("<0x{b:02X}>"), 100 + b);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .byte_fallback(true)
            .unk_token("<unk>".into())
            .build()
            .expect("test BPE");
        let mut tok = Tokenizer::new(bpe);
        tok.with_normalizer(Some(Replace::new(" ", "▁").expect("replace")));
        let decoders: Vec<DecoderWrapper> = vec![
            Replace::new("▁", " ").expect("replace").into(),
            ByteFallback::default().into(),
            Fuse::default().into(),
        ];
        tok.with_decoder(Some(Sequence::new(decoders)));
        tok.add_special_tokens(&[AddedToken::from("<turn|>", true)]);
        tok
    }

    fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
        let mut d = StreamDecoder::new(tok, skip);
        let mut chunks: Vec<String> = ids
            .iter()
            .filter_map(|&id| d.push(id).expect("push"))
            .collect();
        chunks.extend(d.finish().expect("finish"));
        chunks
    }

    #[test]
    fn multibyte_text_streams_exactly() {
        let tok = tokenizer();
        let text = "héllo 世界 🎉";
        let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
        assert!(ids.len() > text.chars().count(), "byte fallback in use");
        let full = tok.decode(&ids, false).expect("decode");
        assert_eq!(full, text);
        let chunks = stream(&tok, &ids, false);
        assert_eq!(chunks.concat(), full);
        assert!(chunks.iter().all(|c| !c.contains(REPLACEMENT)));
    }

    #[test]
    fn special_tokens_can_be_skipped() {
        let tok = tokenizer();
        let turn = tok.token_to_id("<turn|>").expect("special");
        let mut ids = tok.encode("hé", false).expect("encode").get_ids().to_vec();
        ids.push(turn);
        assert_eq!(stream(&tok, &ids, true).concat(), "hé");
        assert_eq!(stream(&tok, &ids, false).concat(), "hé<turn|>");
    }

    #[test]
    fn incomplete_tail_is_flushed_by_finish() {
        let tok = tokenizer();
        let e4 = tok.token_to_id("<0xE4>").expect("byte");
        let h = tok.token_to_id("h").expect("h");
        let mut d = StreamDecoder::new(&tok, false);
        assert_eq!(d.push(h).expect("push").as_deref(), Some("h"));
        assert_eq!(d.push(e4).expect("push"), None);
        assert_eq!(d.finish().expect("finish").as_deref(), Some("\u{FFFD}"));
    }
}
