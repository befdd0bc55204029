//! safetensors header and shape validation: any bytes, opened as a checkpoint's only weight
//! file by the crate's loader and read tensor by tensor, give tensors or typed errors.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = candle_gemma::fuzz_api::open_checkpoint(data);
});
