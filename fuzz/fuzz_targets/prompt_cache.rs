//! The prompt-cache file format: any bytes load as a prompt cache or give a typed error, and a
//! cache that loads can be saved, reloaded, extended by a decode step and rolled back.
//!
//! Input: one byte (how many cached tokens the next prompt shares), then the file.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&shared, file)) = data.split_first() else {
        return;
    };
    let _ = candle_gemma::fuzz_api::exercise_prompt_cache(file, usize::from(shared));
});
