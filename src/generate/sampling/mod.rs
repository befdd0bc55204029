//! Token sampling: logit bias, repetition, frequency and presence penalties, temperature,
//! top-k, top-p and min-p filters, and a seeded draw (the Gumbel-max trick over counter-based
//! noise, [`super::noise`]), so that a given seed draws the same tokens from the same logits
//! wherever it runs (but where two tokens' sums lie within the rounding of the platform's
//! logarithm or exponential), and a device can draw a token from a whole row, or from its best
//! logits under the filters, without copying it to the host.
//!
//! The order of operations follows Hugging Face `transformers`' logits processors (with
//! OpenAI's logit bias first, and its frequency and presence penalties after the repetition
//! penalty, as vLLM applies them): bias and penalties on the raw logits, then temperature,
//! then top-k, top-p and min-p on the tempered distribution, then one draw.
//!
//! ```
//! use candle_gemma::generate::sampling::{Sampler, SamplingOptions};
//!
//! let mut greedy = Sampler::new(SamplingOptions::default());
//! assert_eq!(greedy.sample(&[0.1, 2.0, -1.0], &[]), 1);
//!
//! let opts = SamplingOptions { temperature: 0.8, top_k: Some(2), seed: 7, ..Default::default() };
//! let (mut a, mut b) = (Sampler::new(opts.clone()), Sampler::new(opts));
//! let logits = [0.5, 0.4, 0.3, 0.2];
//! assert_eq!(a.sample(&logits, &[]), b.sample(&logits, &[]));
//! ```

use super::noise::{gumbel_argmax, NoiseKey};
use super::penalties::Penalties;

/// How the next token is chosen from the logits.
///
/// Values that would make a filter meaningless disable it instead of failing:
/// `top_k: Some(0)`, `top_p >= 1`, `min_p <= 0`, a repetition penalty that is not a
/// positive finite number (or exactly 1), frequency or presence penalties that are 0 or not
/// finite, and biases that are 0 or not finite are all no-ops. A temperature that is `<= 0` or
/// not finite means greedy decoding. The logit bias and the penalties apply before
/// temperature: the bias, the repetition penalty over the history (prompt and generated
/// tokens), then the frequency and presence penalties over the generated tokens (those the
/// sampler drew), as vLLM orders them.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// Softmax temperature; `0` selects greedy (argmax) decoding.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability sums to at least `p`.
    pub top_p: Option<f32>,
    /// Drop tokens whose probability is below `min_p` times the most likely token's.
    pub min_p: Option<f32>,
    /// HF-style repetition penalty (`> 1` discourages tokens already in the history).
    pub repetition_penalty: Option<f32>,
    /// OpenAI's frequency penalty: subtracted from a token's logit once for every time it was
    /// generated so far (positive values discourage repeats).
    pub frequency_penalty: Option<f32>,
    /// OpenAI's presence penalty: subtracted from the logit of every token generated so far.
    pub presence_penalty: Option<f32>,
    /// OpenAI's logit bias: `(token id, bias)` pairs added to those tokens' logits before the
    /// penalties (-100 in effect bans a token, +100 in effect forces it). A later pair for the
    /// same id replaces an earlier one; ids outside the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the PRNG; the same seed and inputs give the same tokens.
    pub seed: u64,
}

impl Default for SamplingOptions {
    /// Greedy decoding, no filters, seed 0.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            frequency_penalty: None,
            presence_penalty: None,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingOptions {
    /// The sampling the checkpoint's `generation_config.json` recommends
    /// ([`crate::config::Config::recommended_sampling`]: Gemma 4's is temperature 1, top-k 64,
    /// top-p 0.95), with `seed`; greedy decoding where it recommends none.
    pub fn recommended(config: &crate::config::Config, seed: u64) -> Self {
        match &config.recommended_sampling {
            Some(o) => Self { seed, ..o.clone() },
            None => Self {
                seed,
                ..Self::default()
            },
        }
    }
}

/// A stateful sampler: the options, the count of its tempered draws (each draw's noise is keyed
/// by the seed and that count), and the counts of the tokens it drew (for the frequency and
/// presence penalties).
#[derive(Debug, Clone)]
pub struct Sampler {
    opts: SamplingOptions,
    key: NoiseKey,
    draws: u64,
    penalties: Penalties,
    /// Scratch `(token id, logit / temperature)` pairs, reused across calls.
    scratch: Vec<(u32, f32)>,
    /// Scratch probabilities of the sorted pool (top-p and min-p).
    probs: Vec<f32>,
}

/// A tempered draw that a device may make itself ([`Sampler::device_draw`]): the token with
/// the largest `logit / temperature + noise::gumbel(key, draw, id)` among those the filters
/// keep, the lowest id among equal sums, NaN and -inf logits left out, id 0 where every logit
/// is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceDraw {
    /// The temperature (above 0 and finite).
    pub temperature: f32,
    /// The noise key ([`super::noise::NoiseKey`]'s words).
    pub key: [u32; 2],
    /// The draw's index among the sampler's tempered draws.
    pub draw: u64,
    /// The filters, drawn from the row's best logits; `None`: a draw over the whole row, which
    /// needs no sorting and no other token's probability.
    pub filter: Option<DrawFilter>,
}

/// The filters of a [`DeviceDraw`] from a row's best logits: its `top_k` best under the key
/// `logit / temperature`, then the top-p and min-p filters on their softmax, as
/// [`Sampler::sample`] applies them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawFilter {
    /// The top-k: 1 to [`DEVICE_TOP_K_MAX`].
    pub top_k: usize,
    /// The top-p, below 1 (`None`: off).
    pub top_p: Option<f32>,
    /// The min-p, above 0 (`None`: off).
    pub min_p: Option<f32>,
}

/// The largest top-k a [`DeviceDraw`] filters with (the most candidates a device picks a row);
/// samplers with a larger one are drawn on the host.
pub const DEVICE_TOP_K_MAX: usize = crate::kernels::ops::candidates::MAX_CANDIDATES;

impl Sampler {
    /// Creates a sampler whose PRNG is seeded from `opts.seed`.
    pub fn new(opts: SamplingOptions) -> Self {
        let key = NoiseKey::from_seed(opts.seed);
        let penalties = Penalties::new(
            opts.repetition_penalty,
            opts.frequency_penalty,
            opts.presence_penalty,
            &opts.logit_bias,
        );
        Self {
            opts,
            key,
            draws: 0,
            penalties,
            scratch: Vec::new(),
            probs: Vec::new(),
        }
    }

    /// The options this sampler was built with.
    pub fn options(&self) -> &SamplingOptions {
        &self.opts
    }

    /// Whether [`Sampler::sample`] is a plain argmax (greedy, no penalty that changes a logit),
    /// which the caller may then compute where the logits live.
    pub fn is_plain_greedy(&self) -> bool {
        let t = self.opts.temperature;
        !(self.penalties.any() || t.is_finite() && t > 0.0)
    }

    /// Chooses the next token.
    ///
    /// `logits`: `[vocab]`, one score per token id. `history`: the tokens generated (and, if
    /// the caller wishes, prompted) so far; only used by the repetition penalty, ids outside
    /// the vocabulary are ignored. The frequency and presence penalties count the tokens this
    /// sampler returned. NaN logits count as `-inf`. Greedy decoding breaks ties toward the
    /// lowest id. An empty `logits` slice yields token `0`.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let mut scores: Vec<f32> = logits
            .iter()
            .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
            .collect();
        self.penalties.apply(&mut scores, history);
        let t = self.opts.temperature;
        let token = if !(t.is_finite() && t > 0.0) {
            argmax(&scores)
        } else {
            self.sample_tempered(&scores, t)
        };
        self.penalties.record(token);
        token
    }

    /// What this sampler needs of a row where it need not read all of it: its best logits
    /// under the key `logit / temperature` (the logit itself for greedy decoding, temperature
    /// 0), to pass to [`Sampler::sample_from_best`] with the same `history`. That is `k + m`
    /// of them for a top-k filter of `k` (1 for greedy decoding), where `m` counts the tokens
    /// the penalties touch at this step. `None` where it reads the whole row: no top-k filter
    /// (sampling), or a penalty that can raise a logit (a repetition penalty below 1, negative
    /// frequency or presence penalties).
    pub fn best_needed(&self, history: &[u32]) -> Option<(usize, f32)> {
        let m = self.penalties.lowered(history)?;
        let t = self.opts.temperature;
        if !(t.is_finite() && t > 0.0) {
            return Some((1 + m, 0.0));
        }
        self.opts.top_k.filter(|&k| k > 0).map(|k| (k + m, t))
    }

    /// Chooses the next token from a row's best logits alone: `best` holds at least the
    /// [`Sampler::best_needed`] count of `(id, logit)` pairs, best first under the key
    /// `logit / temperature` (the logit itself for greedy decoding, zeros of either sign
    /// equal), the lowest id first among equal keys, NaN and -inf logits last; or the whole
    /// row, in that order, where it is shorter. The penalties lower logits only, so the best
    /// after them are among those pairs. Draws exactly what [`Sampler::sample`] draws from the
    /// whole row with the same `history` (the same penalties and filters, in the same order,
    /// on the same pairs) and advances the PRNG alike.
    pub fn sample_from_best(&mut self, best: &[(u32, f32)], history: &[u32]) -> u32 {
        let mut pairs: Vec<(u32, f32)> = best
            .iter()
            .map(|&(i, l)| (i, if l.is_nan() { f32::NEG_INFINITY } else { l }))
            .collect();
        self.penalties.apply_pairs(&mut pairs, history);
        let t = self.opts.temperature;
        let token = if !(t.is_finite() && t > 0.0) {
            argmax_of_pairs(&mut pairs)
        } else {
            let pool = &mut self.scratch;
            pool.clear();
            pool.extend(
                pairs
                    .iter()
                    .filter(|(_, s)| *s > f32::NEG_INFINITY)
                    .map(|&(i, s)| (i, s / t)),
            );
            if pool.is_empty() {
                // Every score is -inf: the host's argmax of the whole row then takes id 0.
                0
            } else {
                self.draw_from_pool()
            }
        };
        self.penalties.record(token);
        token
    }

    /// What this sampler needs of a row, where it need not read all of it, for a top-p or
    /// min-p filter without a top-k: the temperature whose key ranks the row's best logits, to
    /// pass them with the row's softmax mass to [`Sampler::sample_from_nucleus`]. `Some` for a
    /// tempered sampler with top-p below 1 or min-p above 0, no top-k and no penalty.
    pub fn nucleus_needed(&self, history: &[u32]) -> Option<f32> {
        let _ = history;
        let t = self.opts.temperature;
        let nucleus = self.opts.top_p.is_some_and(|p| p.is_finite() && p < 1.0)
            || self.opts.min_p.is_some_and(|m| m.is_finite() && m > 0.0);
        let top_k = self.opts.top_k.is_some_and(|k| k > 0);
        (t.is_finite() && t > 0.0 && nucleus && !top_k && !self.penalties.any()).then_some(t)
    }

    /// Draws from a row's best logits when the top-p and min-p filters keep only some of them:
    /// `best` as [`Sampler::sample_from_best`] takes it (best first under `logit /
    /// temperature`), `mass` the row's softmax mass (the sum over its logits, NaN and -inf left
    /// out, of `exp((key - max_key) as f64)`), `row_len` the row's length. The same draw as
    /// [`Sampler::sample`] on the whole row, but for the order of `mass`'s sum; `None` (the
    /// sampler unchanged) where the filters' cut lies past `best`, or the mass is not a
    /// positive finite number: the caller then reads the whole row.
    pub fn sample_from_nucleus(
        &mut self,
        best: &[(u32, f32)],
        mass: f64,
        row_len: usize,
    ) -> Option<u32> {
        let t = self.nucleus_needed(&[])?;
        if !(mass.is_finite() && mass > 0.0) {
            return None;
        }
        let whole = best.len() >= row_len;
        let pool: Vec<(u32, f32)> = best
            .iter()
            .filter(|(_, l)| *l > f32::NEG_INFINITY)
            .map(|&(i, l)| (i, l / t))
            .collect();
        let max = pool.first()?.1;
        let probs: Vec<f32> = pool
            .iter()
            .map(|e| {
                let p = ((e.1 - max) as f64).exp() as f32;
                (p as f64 / mass) as f32
            })
            .collect();
        // Each filter's cut, `None` where it lies past the candidates.
        let mut cuts = Vec::new();
        if let Some(p) = self.opts.top_p.filter(|p| p.is_finite() && *p < 1.0) {
            let mut cumulative = 0.0f32;
            let reached = probs.iter().position(|q| {
                cumulative += q;
                cumulative >= p
            });
            cuts.push(reached.map(|i| i + 1).or(whole.then_some(pool.len())));
        }
        if let Some(min_p) = self.opts.min_p.filter(|m| m.is_finite() && *m > 0.0) {
            let threshold = probs[0] * min_p;
            let kept = probs.iter().take_while(|&&q| q >= threshold).count();
            cuts.push((kept < pool.len() || whole).then_some(kept));
        }
        let keep = cuts.iter().flatten().min().copied()?;
        let (draw, key) = (self.draws, self.key);
        self.draws += 1;
        let token = gumbel_argmax(&pool[..keep.max(1)], key, draw).unwrap_or(0);
        self.penalties.record(token);
        Some(token)
    }

    /// The draw a device may make for this sampler with the same `history` ([`DeviceDraw`]):
    /// `Some` for a tempered sampler without penalties (and without a logit bias) whose
    /// filters, if any, include a top-k of at most [`DEVICE_TOP_K_MAX`] (top-p and min-p then
    /// cut among those); a top-p or min-p without a top-k needs the whole row's distribution,
    /// and is drawn another way. Pass the token the device picked to
    /// [`Sampler::accept_device_draw`]; it is the token [`Sampler::sample`] draws from that
    /// row.
    pub fn device_draw(&self, history: &[u32]) -> Option<DeviceDraw> {
        let _ = history;
        let t = self.opts.temperature;
        if !(t.is_finite() && t > 0.0) || self.penalties.any() {
            return None;
        }
        let top_k = self.opts.top_k.filter(|&k| k > 0);
        let top_p = self.opts.top_p.filter(|p| p.is_finite() && *p < 1.0);
        let min_p = self.opts.min_p.filter(|m| m.is_finite() && *m > 0.0);
        let filter = match top_k {
            Some(k) if k <= DEVICE_TOP_K_MAX => Some(DrawFilter {
                top_k: k,
                top_p,
                min_p,
            }),
            Some(_) => return None,
            None if top_p.is_some() || min_p.is_some() => return None,
            None => None,
        };
        Some(DeviceDraw {
            temperature: t,
            key: self.key.0,
            draw: self.draws,
            filter,
        })
    }

    /// Takes `token`, drawn elsewhere as [`Sampler::device_draw`] asked, as this sampler's
    /// draw: the next draw gets fresh noise, as after [`Sampler::sample`].
    pub fn accept_device_draw(&mut self, token: u32) {
        self.draws += 1;
        self.penalties.record(token);
    }

    fn sample_tempered(&mut self, scores: &[f32], temperature: f32) -> u32 {
        let pool = &mut self.scratch;
        pool.clear();
        pool.extend(
            scores
                .iter()
                .enumerate()
                .filter(|(_, s)| **s > f32::NEG_INFINITY)
                .map(|(i, &s)| (i as u32, s / temperature)),
        );
        if pool.is_empty() {
            return argmax(scores);
        }
        self.draw_from_pool()
    }

    /// The top-k, top-p and min-p filters and the draw, on the `(id, logit / temperature)`
    /// pairs in the scratch pool (not empty): the Gumbel-max draw over the tokens the filters
    /// keep. Without filters nothing is sorted.
    fn draw_from_pool(&mut self) -> u32 {
        let (draw, key) = (self.draws, self.key);
        self.draws += 1;
        let top_k = self.opts.top_k.filter(|&k| k > 0);
        let top_p = self.opts.top_p.filter(|p| p.is_finite() && *p < 1.0);
        let min_p = self.opts.min_p.filter(|m| m.is_finite() && *m > 0.0);
        let pool = &mut self.scratch;
        if top_k.is_some() || top_p.is_some() || min_p.is_some() {
            // Descending score, ascending id on ties: every filter below keeps a prefix.
            let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
            if let Some(k) = top_k.filter(|&k| k < pool.len()) {
                // Partition first so that only the k survivors are sorted (vocab is 262k).
                pool.select_nth_unstable_by(k - 1, order);
                pool.truncate(k);
            }
            pool.sort_unstable_by(order);
            // Softmax over the survivors (max-subtracted; the first entry is the max).
            let probs = &mut self.probs;
            probs.clear();
            let max = pool[0].1;
            let mut total = 0.0f64;
            for entry in pool.iter() {
                let p = ((entry.1 - max) as f64).exp();
                probs.push(p as f32);
                total += p;
            }
            for p in probs.iter_mut() {
                *p = (*p as f64 / total) as f32;
            }
            let mut keep = pool.len();
            if let Some(p) = top_p {
                let mut cumulative = 0.0f32;
                for (i, q) in probs.iter().enumerate() {
                    cumulative += q;
                    if cumulative >= p {
                        keep = i + 1;
                        break;
                    }
                }
            }
            if let Some(min_p) = min_p {
                let threshold = probs[0] * min_p;
                keep = keep.min(probs.iter().take_while(|&&q| q >= threshold).count());
            }
            pool.truncate(keep.max(1));
        }
        gumbel_argmax(pool, key, draw).unwrap_or(0)
    }
}

/// [`argmax`] of a row given as some of its `(id, score)` pairs that hold its largest score:
/// the lowest id with the largest score, 0 where every score is -inf.
fn argmax_of_pairs(pairs: &mut [(u32, f32)]) -> u32 {
    pairs.sort_unstable_by_key(|p| p.0);
    let mut best: Option<(u32, f32)> = None;
    for &(i, s) in pairs.iter() {
        if best.is_none_or(|b| s > b.1) {
            best = Some((i, s));
        }
    }
    match best {
        Some((i, s)) if s > f32::NEG_INFINITY => i,
        _ => 0,
    }
}

/// Index of the largest score, the lowest index among equals; 0 for an empty slice.
fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests;
