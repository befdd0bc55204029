//! The streaming output parser: any text, split into chunks anywhere, gives the same events as
//! the whole text at once, never shows a special-token string in its text or thinking (nor in
//! all of either joined), and never panics.
//!
//! Input: one byte (bit 0: the output starts inside a thought), then the text, in which each
//! `0xFF` byte (never part of UTF-8) marks a chunk boundary.

#![no_main]

use candle_gemma::fuzz_api;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((chunked, whole)) = fuzz_api::parse_output_chunks(data) else {
        return;
    };
    assert_eq!(chunked, whole, "input {data:?}");
    if let Some((s, kind, joined)) = fuzz_api::leaked_special_token(&chunked) {
        panic!("{s} in the {kind} {joined:?} from input {data:?}");
    }
});
