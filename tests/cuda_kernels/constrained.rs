//! Constrained decoding on the GPU (the e2b-hf fixture with its tokenizer): greedy and drawn on
//! the device (the recommended top-k 64, top-p 0.95) give the CPU's tokens in f32 and output
//! valid under the schema in f32 and bf16; in a batch decoding ahead, the rows
//! beside a constrained one give the tokens they give alone (compared in f32); the bit mask
//! kernel blocks exactly the tokens whose bits are clear.

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use candle_gemma::generate::{BatchSession, Constraint, SamplingOptions};
use candle_gemma::{GenOptions, Model};

use crate::common::{bounded_schema, fits_bounded_schema, fixture};
use crate::support::gpu;

fn schema() -> Constraint {
    Constraint::JsonSchema(bounded_schema())
}

fn options(constraint: Option<Constraint>, seed: Option<u64>) -> GenOptions {
    GenOptions {
        max_tokens: 60,
        constraint,
        sampling: match seed {
            Some(seed) => SamplingOptions {
                temperature: 1.0,
                top_k: Some(64),
                top_p: Some(0.95),
                seed,
                ..Default::default()
            },
            None => SamplingOptions::default(),
        },
        ..Default::default()
    }
}

fn load(device: &Device, dtype: DType) -> Result<Model> {
    Ok(Model::builder()
        .path(fixture("e2b-hf"))
        .device(device.clone())
        .dtype(dtype)
        .build()?)
}

fn valid(text: &str) -> bool {
    fits_bounded_schema(text)
}

#[test]
fn constrained_decoding_on_the_gpu_holds_and_leaves_other_rows_alone() -> Result<()> {
    let Some(gpu) = gpu("constrained decoding") else {
        return Ok(());
    };
    let mut failures = Vec::new();
    let cpu = load(&Device::Cpu, DType::F32)?;
    let prompt = cpu.encode("Describe it", true)?;
    let want = cpu
        .generator(options(Some(schema()), None))
        .generate(&prompt)?;
    for dtype in [DType::F32, DType::BF16] {
        let model = load(&gpu.dev, dtype)?;
        let greedy = model
            .generator(options(Some(schema()), None))
            .generate(&prompt)?;
        println!("{dtype:?} greedy: {:?}", greedy.text);
        if !valid(&greedy.text) || (dtype == DType::F32 && greedy.tokens != want.tokens) {
            failures.push(format!(
                "{dtype:?} greedy {:?} (cpu {:?})",
                greedy.text, want.text
            ));
        }
        // Seeds whose draws on the CPU differ from greedy decoding and from each other.
        for seed in [3, 4] {
            let drawn = model
                .generator(options(Some(schema()), Some(seed)))
                .generate(&prompt)?;
            let host = cpu
                .generator(options(Some(schema()), Some(seed)))
                .generate(&prompt)?;
            println!(
                "{dtype:?} seed {seed}: {:?} (cpu {:?})",
                drawn.text, host.text
            );
            if !valid(&drawn.text) || (dtype == DType::F32 && drawn.tokens != host.tokens) {
                failures.push(format!(
                    "{dtype:?} seed {seed}: {:?} vs cpu {:?}",
                    drawn.text, host.text
                ));
            }
        }
        // A batch decoding ahead, one row constrained: the others as alone.
        let prompts: Vec<Vec<u32>> = ["Tell me", "Describe it", "Once upon"]
            .iter()
            .map(|p| model.encode(p, true))
            .collect::<candle_gemma::Result<_>>()?;
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| Ok(model.generator(options(None, None)).generate(p)?.tokens))
            .collect::<Result<_>>()?;
        let mut batch = BatchSession::new(&model, options(None, None));
        let mut ids = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            ids.push(batch.add_with(p, options((i == 1).then(schema), None))?);
        }
        let mut tokens = vec![Vec::new(); 3];
        let mut text = String::new();
        let mut done = 0;
        while done < 3 {
            for (id, step) in batch.step()? {
                let Some(row) = ids.iter().position(|&s| s == id) else {
                    bail!("unknown sequence");
                };
                tokens[row].push(step.token);
                if row == 1 {
                    text.push_str(&step.text);
                }
                done += usize::from(step.finish.is_some());
            }
        }
        // In bf16 a batch's products round differently from one row's, so rows may part
        // from their single decode at a near-tie with or without a constraint; the exact
        // comparison is f32's.
        let exact = dtype != DType::F32 || (tokens[0] == alone[0] && tokens[2] == alone[2]);
        if !exact || !valid(&text) {
            failures.push(format!(
                "{dtype:?} batch: {:?} vs {:?}, {:?} vs {:?}, {text:?}",
                tokens[0], alone[0], tokens[2], alone[2]
            ));
        }
    }
    if !failures.is_empty() {
        bail!("{failures:#?}");
    }
    Ok(())
}

/// The bit mask kernel against the host: random logits and bits at Gemma's vocabulary and an
/// odd width (a last word partly past it).
#[test]
fn bit_masks_block_exactly_the_clear_bits() -> Result<()> {
    let Some(gpu) = gpu("mask_by_bits") else {
        return Ok(());
    };
    for (rows, vocab) in [(3usize, 262_144usize), (5, 1000)] {
        let words = vocab.div_ceil(32);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bits: Vec<u32> = (0..rows * words).map(|_| next() as u32).collect();
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|_| (next() % 2000) as f32 / 100.0 - 10.0)
            .collect();
        let lt = candle_core::Tensor::from_vec(logits.clone(), (rows, vocab), &gpu.dev)?;
        let bt = candle_core::Tensor::from_vec(bits.clone(), (rows, words), &gpu.dev)?;
        let got: Vec<f32> = candle_gemma::kernels::cuda::reduce::mask_by_bits(&lt, &bt)?
            .flatten_all()?
            .to_vec1()?;
        for (i, (&g, &l)) in got.iter().zip(&logits).enumerate() {
            let (r, t) = (i / vocab, i % vocab);
            let want = if (bits[r * words + t / 32] >> (t % 32)) & 1 == 1 {
                l
            } else {
                f32::NEG_INFINITY
            };
            if g != want {
                bail!("[{rows}x{vocab}] row {r} token {t}: {g} against {want}");
            }
        }
    }
    Ok(())
}
