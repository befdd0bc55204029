//! Constrained decoding on a fixture (random weights, the real tokenizer structure): a JSON
//! schema, a regular expression and a Lark grammar hold the output, greedy and sampled, alone
//! and in a batch beside unconstrained rows (which decode as they would alone), and a
//! constraint that cannot run is a typed error.

mod common;

use candle_gemma::generate::{BatchSession, Constraint, SamplingOptions};
use candle_gemma::{Error, FinishReason, GenOptions, Model};
use common::*;
use serde_json::{json, Value};

fn options(constraint: Option<Constraint>, sampling: SamplingOptions) -> GenOptions {
    GenOptions {
        max_tokens: 80,
        constraint,
        sampling,
        ..Default::default()
    }
}

fn tempered(seed: u64) -> SamplingOptions {
    SamplingOptions {
        temperature: 1.0,
        top_k: Some(64),
        top_p: Some(0.95),
        seed,
        ..Default::default()
    }
}

fn generate(model: &Model, prompt: &str, opts: GenOptions) -> candle_gemma::generate::Output {
    let ids = model.encode(prompt, true).expect("encode");
    model.generator(opts).generate(&ids).expect("generate")
}

/// The text fits [`bounded_schema`].
fn assert_bounded_object(text: &str) {
    assert!(fits_bounded_schema(text), "{text:?}");
}

#[test]
fn a_json_schema_holds_greedy_and_sampled_output() {
    let model = load("e2b-hf");
    let free = generate(
        &model,
        "Describe it",
        options(None, SamplingOptions::default()),
    );
    assert!(
        serde_json::from_str::<Value>(&free.text).is_err(),
        "the unconstrained output should not already be JSON: {:?}",
        free.text
    );
    let schema = Constraint::JsonSchema(bounded_schema());
    let greedy = generate(
        &model,
        "Describe it",
        options(Some(schema.clone()), SamplingOptions::default()),
    );
    assert!(matches!(greedy.finish, FinishReason::Eos(_)), "{greedy:?}");
    assert_bounded_object(&greedy.text);
    for seed in [1, 2, 3] {
        let out = generate(
            &model,
            "Describe it",
            options(Some(schema.clone()), tempered(seed)),
        );
        assert!(matches!(out.finish, FinishReason::Eos(_)), "{out:?}");
        assert_bounded_object(&out.text);
    }
}

#[test]
fn a_regex_and_a_lark_grammar_hold_the_whole_output() {
    let model = load("e2b-hf");
    let rx = generate(
        &model,
        "Code:",
        options(
            Some(Constraint::Regex("[a-c]{3}-[0-9]{2}".to_string())),
            tempered(7),
        ),
    );
    assert!(matches!(rx.finish, FinishReason::Eos(_)), "{rx:?}");
    let t = rx.text.as_bytes();
    assert_eq!(t.len(), 6, "{:?}", rx.text);
    assert!(
        t[..3].iter().all(|c| (b'a'..=b'c').contains(c)),
        "{:?}",
        rx.text
    );
    assert_eq!(t[3], b'-');
    assert!(t[4..].iter().all(u8::is_ascii_digit), "{:?}", rx.text);

    let lark = r#"start: "yes" | "no" | "maybe""#;
    let out = generate(
        &model,
        "Answer:",
        options(Some(Constraint::Lark(lark.to_string())), tempered(9)),
    );
    assert!(
        matches!(out.text.as_str(), "yes" | "no" | "maybe"),
        "{out:?}"
    );
}

#[test]
fn a_constrained_row_leaves_the_other_rows_of_a_batch_as_they_decode_alone() {
    let model = load("e2b-hf");
    let prompts = ["Tell me", "Describe it", "Once upon"];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| generate(&model, p, options(None, SamplingOptions::default())).tokens)
        .collect();
    let mut batch = BatchSession::new(&model, options(None, SamplingOptions::default()));
    let mut ids = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let prompt = model.encode(p, true).expect("encode");
        let constraint = (i == 1).then(|| Constraint::JsonSchema(bounded_schema()));
        let opts = options(constraint, SamplingOptions::default());
        ids.push(batch.add_with(&prompt, opts).expect("add"));
    }
    let mut tokens = vec![Vec::new(); prompts.len()];
    let mut texts = vec![String::new(); prompts.len()];
    let mut done = 0;
    while done < prompts.len() {
        for (id, step) in batch.step().expect("step") {
            let row = ids.iter().position(|&s| s == id).expect("known id");
            tokens[row].push(step.token);
            texts[row].push_str(&step.text);
            done += usize::from(step.finish.is_some());
        }
    }
    assert_eq!(tokens[0], alone[0]);
    assert_eq!(tokens[2], alone[2]);
    assert_bounded_object(&texts[1]);
}

#[test]
fn a_constraint_that_cannot_run_is_a_typed_error() {
    let model = load("e2b-hf");
    let ids = model.encode("Hi", true).expect("encode");
    let bad = options(
        Some(Constraint::Regex("([a-z".to_string())),
        SamplingOptions::default(),
    );
    let err = model
        .generator(bad)
        .generate(&ids)
        .expect_err("a malformed pattern");
    assert!(matches!(err, Error::Constraint(_)), "{err}");
    let unknown = json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}});
    let err = model
        .generator(options(
            Some(Constraint::JsonSchema(unknown)),
            SamplingOptions::default(),
        ))
        .generate(&ids)
        .expect_err("an unknown schema type");
    assert!(matches!(err, Error::Constraint(_)), "{err}");
    let mut batch = BatchSession::new(&model, options(None, SamplingOptions::default()));
    let bad = options(
        Some(Constraint::Lark("start: (".to_string())),
        SamplingOptions::default(),
    );
    assert!(matches!(
        batch.add_with(&ids, bad),
        Err(Error::Constraint(_))
    ));

    // No tokenizer: nothing to spell the output with.
    let config = model.config().clone();
    let random = Model::random(
        config,
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
        1,
    )
    .expect("random model");
    let err = random
        .generator(options(
            Some(Constraint::JsonObject),
            SamplingOptions::default(),
        ))
        .generate(&ids)
        .expect_err("no tokenizer");
    assert!(matches!(err, Error::Constraint(_)), "{err}");
}

#[test]
fn constrained_rows_batched_together_give_what_each_gives_alone() {
    let model = load("e2b-hf");
    let prompt = model.encode("Describe it", true).expect("encode");
    let schema = Constraint::JsonSchema(bounded_schema());
    let alone: Vec<String> = (1..=4)
        .map(|seed| {
            model
                .generator(options(Some(schema.clone()), tempered(seed)))
                .generate(&prompt)
                .expect("generate")
                .text
        })
        .collect();
    let mut batch = BatchSession::new(&model, options(None, SamplingOptions::default()));
    let ids: Vec<_> = (1..=4)
        .map(|seed| {
            batch
                .add_with(&prompt, options(Some(schema.clone()), tempered(seed)))
                .expect("add")
        })
        .collect();
    let mut texts = vec![String::new(); ids.len()];
    let mut done = 0;
    while done < ids.len() {
        for (id, step) in batch.step().expect("step") {
            let row = ids.iter().position(|&s| s == id).expect("known id");
            texts[row].push_str(&step.text);
            done += usize::from(step.finish.is_some());
        }
    }
    assert_eq!(texts, alone);
    assert!(texts.iter().all(|t| fits_bounded_schema(t)), "{texts:?}");
    assert!(
        texts.iter().any(|t| *t != texts[0]),
        "seeds should differ: {texts:?}"
    );
}

#[test]
fn a_random_weight_model_given_a_tokenizer_takes_constraints() {
    let fixture = load("e2b-hf");
    let tokenizer = fixture.tokenizer().expect("tokenizer").clone();
    let mut config = fixture.config().clone();
    let random = |config| {
        Model::random(
            config,
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
            1,
        )
    };
    let model = random(config.clone())
        .expect("random")
        .with_tokenizer(tokenizer.clone())
        .expect("fits the vocabulary");
    model
        .check_constraint(&Constraint::JsonObject)
        .expect("a constraint compiles over the given tokenizer");
    let out = generate(
        &model,
        "Describe it",
        options(
            Some(Constraint::JsonSchema(bounded_schema())),
            SamplingOptions::default(),
        ),
    );
    assert_bounded_object(&out.text);
    config.vocab_size = 100;
    let small = random(config).expect("random");
    assert!(matches!(
        small.with_tokenizer(tokenizer),
        Err(Error::Tokenizer(_))
    ));
}

#[test]
fn a_constraint_started_again_starts_fresh_from_the_kept_parser() {
    let model = load("e2b-hf");
    let c = Constraint::JsonSchema(bounded_schema());
    let mut a = model.constraint(&c).expect("starts");
    let first = a.allowed().expect("mask");
    for _ in 0..4 {
        let m = a.allowed().expect("mask");
        let t = m.iter().position(|&x| x == 1).expect("a token");
        a.accept(t as u32).expect("accept");
    }
    let walked = a.allowed().expect("mask");
    assert_ne!(walked, first, "four tokens in, the mask has moved");
    // The second start copies the first's fresh parser, not the one that moved on.
    let mut b = model.constraint(&c).expect("starts again");
    assert_eq!(b.allowed().expect("mask"), first);
    assert_eq!(
        a.allowed().expect("mask"),
        walked,
        "the first is left as it was"
    );
    // Another constraint is not mistaken for it.
    let mut rx = model
        .constraint(&Constraint::Regex("[0-9]+".into()))
        .expect("starts");
    assert_ne!(rx.allowed().expect("mask"), first);
}
