//! `config.json` parsing and validation: any bytes give a validated config or a typed error,
//! and a config that validates keeps the invariants the model relies on.

#![no_main]

use candle_gemma::config::KvSource;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = candle_gemma::fuzz_api::parse_config(data) else {
        return;
    };
    let first_shared = config.first_kv_shared_layer;
    assert!(first_shared <= config.num_layers());
    assert!(!config.eos_token_ids.is_empty());
    for (i, layer) in config.layers.iter().enumerate() {
        assert!(layer.kv_heads > 0);
        assert_eq!(config.num_attention_heads % layer.kv_heads, 0);
        assert_eq!(layer.head_dim % 2, 0);
        match layer.kv {
            KvSource::Own => assert!(i < first_shared),
            KvSource::Shared { producer } => {
                assert!(i >= first_shared && producer < first_shared);
                assert_eq!(config.layers[producer].kind, layer.kind);
            }
        }
    }
});
