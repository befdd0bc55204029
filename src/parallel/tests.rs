//! The sharded forward on CPU ranks (summing through the host) against the goldens and the
//! whole model, and a failing rank stopping every rank.

use std::path::PathBuf;
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::*;
use crate::kernels::testutil::max_abs_diff;
use crate::{CacheConfig, GenOptions};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn sharded(name: &str, world: usize) -> ShardedModel {
    Model::builder()
        .path(fixture(name))
        .build_sharded_on(world, |_| Ok(Device::Cpu))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn forward(m: &Model, prompt: &[u32]) -> Result<Tensor> {
    let mut cache = m.new_cache(&CacheConfig::default())?;
    m.forward(&[prompt.to_vec()], &mut cache)
}

#[test]
fn two_cpu_ranks_give_the_goldens_tokens_and_the_whole_models_logits() {
    for name in [
        "dense-sharded",
        "e2b-hf",
        "e4b-text",
        "moe-mlx",
        "moe-q4",
        "e2b-q4",
        "e2b-q8",
    ] {
        let golden: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("golden.json")).unwrap(),
        )
        .unwrap();
        let sm = sharded(name, 2);
        let whole = Model::builder().path(fixture(name)).build().unwrap();
        for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
            let ids = |k: &str| -> Vec<u32> {
                case[k]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect()
            };
            let (prompt, want) = (ids("prompt_ids"), ids("greedy_ids"));
            let near_tie = case["margins"]
                .as_array()
                .unwrap()
                .iter()
                .position(|m| m.as_f64().unwrap() < 0.01)
                .unwrap_or(want.len());
            let opts = GenOptions {
                max_tokens: want.len(),
                ignore_eos: true,
                ..Default::default()
            };
            let outs = sm
                .run(|m| m.generator(opts.clone()).generate(&prompt))
                .unwrap();
            assert_eq!(
                outs[0].tokens, outs[1].tokens,
                "{name} case {i}: ranks differ"
            );
            assert_eq!(
                outs[0].tokens[..near_tie],
                want[..near_tie],
                "{name} case {i}: sharded ids differ from the goldens"
            );
            let got = sm.run(|m| forward(m, &prompt)).unwrap();
            let reference = forward(&whole, &prompt).unwrap();
            let diff = max_abs_diff(&got[0], &reference);
            assert!(diff < 2e-3, "{name} case {i}: logits differ by {diff}");
        }
    }
}

#[test]
fn a_rank_that_fails_stops_every_rank_with_a_typed_error() {
    let sm = sharded("dense-sharded", 2).failure_grace(Duration::from_millis(300));
    assert_eq!(
        (sm.world(), sm.ranks()[1].rank(), sm.ranks()[1].world()),
        (2, 1, 2)
    );
    // The same bad input on every rank: all fail alike, before any all-reduce; the group
    // stays usable.
    let err = sm.run(|m| forward(m, &[100_000])).unwrap_err();
    assert!(matches!(err, Error::Rank { .. }), "{err}");
    sm.run(|m| forward(m, &[2, 10, 20])).unwrap();
    // Rank 1 fails before its forward: rank 0 waits in its first all-reduce until the group
    // is aborted, and returns an error too.
    let err = sm
        .run(|m| {
            if m.rank() == 1 {
                return Err(Error::Input("injected failure".into()));
            }
            forward(m, &[2, 10, 20])
        })
        .unwrap_err();
    match &err {
        Error::Rank { rank: 1, reason } => assert!(reason.contains("injected"), "{err}"),
        other => panic!("expected rank 1's error, got {other}"),
    }
    // An aborted group does not run again.
    assert!(matches!(
        sm.run(|m| forward(m, &[2, 10, 20])),
        Err(Error::Rank { .. })
    ));
}

#[test]
fn a_rank_that_fails_to_load_is_named() {
    let err = ShardedModel::load(2, |rank| {
        if rank == 1 {
            return Err(Error::Input("no such GPU".into()));
        }
        Model::builder().path(fixture("dense-sharded")).build()
    })
    .unwrap_err();
    match err {
        Error::Rank { rank: 1, reason } => assert!(reason.contains("no such GPU")),
        other => panic!("expected rank 1's error, got {other}"),
    }
}

#[test]
fn every_cache_kind_and_batched_decode_run_on_the_ranks_as_on_the_whole_model() {
    use crate::generate::BatchSession;
    use crate::kv::{CacheMode, QuantBits, QuantSpec};
    let name = "e2b-kvq";
    let sm = sharded(name, 2);
    let whole = Model::builder().path(fixture(name)).build().unwrap();
    let prompts: [&[u32]; 3] = [&[2, 17, 40, 99, 3, 8, 11], &[2, 300, 5], &[2, 7, 7, 9, 120]];
    let quantized = |bits| {
        CacheMode::Quantized(QuantSpec {
            bits,
            group_size: 32,
            start: 0,
        })
    };
    for mode in [
        CacheMode::Simple,
        CacheMode::Rotating,
        quantized(QuantBits::Eight),
        quantized(QuantBits::Four),
    ] {
        let opts = GenOptions {
            max_tokens: 12,
            ignore_eos: true,
            cache: CacheConfig { mode },
            ..Default::default()
        };
        let want = whole.generator(opts.clone()).generate(prompts[0]).unwrap();
        let got = sm
            .run(|m| m.generator(opts.clone()).generate(prompts[0]))
            .unwrap();
        assert_eq!(got[0].tokens, want.tokens, "{mode:?}");
        // Batched decode: the ranks' sessions against the whole model's.
        let batch = |m: &Model| -> Result<Vec<Vec<u32>>> {
            let mut session = BatchSession::new(m, opts.clone());
            for p in prompts {
                session.add(p)?;
            }
            let mut out = session.run_to_end()?;
            out.sort_by_key(|(id, _, _)| id.0);
            Ok(out.into_iter().map(|(_, ids, _)| ids).collect())
        };
        let want = batch(&whole).unwrap();
        let got = sm.run(batch).unwrap();
        assert_eq!(got[0], want, "batched, {mode:?}");
        assert_eq!(got[1], want, "batched, rank 1, {mode:?}");
    }
}

#[test]
fn a_prompt_of_several_chunks_runs_on_the_ranks_as_on_the_whole_model() {
    // Earlier chunks only fill the cache (no KV-shared layers, no head and so no all-gather):
    // every rank takes that path alike.
    let name = "e2b-hf";
    let sm = sharded(name, 2);
    let whole = Model::builder().path(fixture(name)).build().unwrap();
    let prompt: Vec<u32> = (0..2 * crate::PREFILL_CHUNK as u32 + 6)
        .map(|i| (i * 37 + 11) % 500 + 3)
        .collect();
    let got = sm.run(|m| forward(m, &prompt)).unwrap();
    let reference = forward(&whole, &prompt).unwrap();
    for (rank, logits) in got.iter().enumerate() {
        let diff = max_abs_diff(logits, &reference);
        assert!(diff < 2e-3, "rank {rank}: logits differ by {diff}");
    }
    let opts = GenOptions {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let want = whole.generator(opts.clone()).generate(&prompt).unwrap();
    let outs = sm
        .run(|m| m.generator(opts.clone()).generate(&prompt))
        .unwrap();
    assert_eq!(outs[0].tokens, want.tokens);
    assert_eq!(outs[1].tokens, want.tokens);
}
