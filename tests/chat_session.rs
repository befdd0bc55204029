//! A multi-turn chat on a fixture: turn 2 prefills only its new tokens, and reusing the cache
//! gives the same answer as a fresh run over the whole conversation.

mod common;

use candle_gemma::chat::ChatSession;
use candle_gemma::{FinishReason, GenOptions};
use common::*;

fn options() -> GenOptions {
    GenOptions {
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn second_turn_prefills_only_its_new_tokens() {
    let model = load("e2b-hf");
    let mut chat = ChatSession::new(&model, options())
        .expect("session")
        .with_system("Be brief.");
    let first = chat.send("Hello there", |_| true).expect("turn 1");
    assert_eq!(first.finish, Some(FinishReason::Length));
    assert_eq!(first.stats.prefilled_tokens, first.stats.prompt_tokens);
    let after_first = chat.history().len();

    let second = chat.send("And now?", |_| true).expect("turn 2");
    // Cached: turn 1's prompt and its generated tokens except the last (sampled, never fed).
    let cached = after_first - 1;
    assert_eq!(second.stats.prompt_tokens, chat.history().len() - 6);
    assert_eq!(
        second.stats.prefilled_tokens,
        second.stats.prompt_tokens - cached,
        "turn 2 must prefill only the tokens after the cached conversation"
    );
    assert!(
        second.stats.prefilled_tokens * 2 < second.stats.prompt_tokens,
        "{:?}",
        second.stats
    );

    // The reused cache gives the same tokens as a fresh run over the same prompt.
    let prompt2 = &chat.history()[..second.stats.prompt_tokens];
    let fresh = greedy(&model, prompt2, 6, Default::default(), None);
    assert_eq!(&chat.history()[second.stats.prompt_tokens..], &fresh[..]);
}

#[test]
fn stopping_an_answer_early_keeps_the_chat_usable() {
    let model = load("e2b-hf");
    let mut chat = ChatSession::new(&model, options()).expect("session");
    let mut seen = 0;
    let cut = chat
        .send("Tell me a story", |_| {
            seen += 1;
            seen < 2
        })
        .expect("turn 1");
    assert_eq!(cut.finish, None, "the caller stopped it");
    let next = chat.send("Go on", |_| true).expect("turn 2");
    assert!(next.stats.prefilled_tokens < next.stats.prompt_tokens);
    assert_eq!(chat.messages().len(), 4);
}
