//! Quantized attention on the CPU, in plain Rust: the reference that device kernels are tested
//! against.
//!
//! It reads the packed codes where they lie, dequantizes one key (and one value) row at a time
//! with its group's scale and bias, and keeps an online softmax, so neither a dense copy of K/V
//! nor the `[heads, q_len, keys]` score matrix is ever held. Per query row:
//!
//! ```text
//! q'     = q * scale                                   (scale folded into q, as MLX does)
//! s_j    = Σ_g  scale_k[j,g] * Σ_{e∈g} code_k[j,e] * q'[e]  +  bias_k[j,g] * Σ_{e∈g} q'[e]
//! m, l   : running max and running Σ exp(s_j - m) over visible keys
//! acc    = Σ_j exp(s_j - m) * (scale_v[j,g(e)] * code_v[j,e] + bias_v[j,g(e)])
//! out    = acc / l
//! ```

use candle_core::{DType, Device, Storage, Tensor};

use super::quant::code_at;
use super::{visible, QueryPlan};
use crate::kv::{CacheError, PackedKv};

/// Packed codes of one K or V, read in place from CPU storage when possible.
struct Codes {
    /// Row-major `[kv_heads, keys, words]` (a copy only when the storage was not on the CPU or
    /// not row-contiguous within a key).
    words: Vec<u32>,
    /// Words per key row (`head_dim * bits / 32`).
    row_words: usize,
    /// Keys per head.
    keys: usize,
}

impl Codes {
    fn read(codes: &Tensor) -> Result<Self, CacheError> {
        let (_, _, keys, row_words) = codes.dims4()?;
        // A narrowed ring view is strided along heads; gather it into one row-major buffer of
        // packed words (the packed size, not a dense copy).
        let words = match codes.device() {
            Device::Cpu => {
                let (storage, layout) = codes.storage_and_layout();
                match (&*storage, layout.stride()) {
                    (Storage::Cpu(cpu), &[_, sh, sk, 1]) => {
                        let data = cpu.as_slice::<u32>()?;
                        let (_, heads, _, _) = codes.dims4()?;
                        let mut out = Vec::with_capacity(heads * keys * row_words); // [kvh, keys, words]
                        let base = layout.start_offset();
                        for h in 0..heads {
                            for j in 0..keys {
                                let at = base + h * sh + j * sk;
                                out.extend_from_slice(&data[at..at + row_words]);
                            }
                        }
                        out
                    }
                    _ => codes.flatten_all()?.to_vec1()?,
                }
            }
            _ => codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?,
        };
        Ok(Self {
            words,
            row_words,
            keys,
        })
    }

    /// The packed words of key `j` of KV head `h`.
    fn row(&self, h: usize, j: usize) -> &[u32] {
        let at = (h * self.keys + j) * self.row_words;
        &self.words[at..at + self.row_words]
    }
}

/// Scales or biases as f32, row-major `[kv_heads, keys, groups]` (one value per group: small).
fn groups_f32(t: &Tensor) -> Result<Vec<f32>, CacheError> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Quantized attention for one sequence.
///
/// `q`: `[1, n_heads, q_len, head_dim]`; `k`, `v`: packed `[1, kv_heads, keys, ...]`;
/// `positions[j]`: absolute position of key `j`. Returns `[1, n_heads, q_len, head_dim]` in
/// `q`'s dtype on `q`'s device.
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedKv,
    v: &PackedKv,
    positions: &[usize],
    plan: &QueryPlan,
) -> Result<Tensor, CacheError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.codes.dims4()?;
    let group = n_heads / kv_heads;
    let (kb, vb) = (k.bits.bits(), v.bits.bits());
    let (kg, vg) = (k.group_size, v.group_size);
    let (k_groups, v_groups) = (head_dim / kg, head_dim / vg);

    let qf: Vec<f32> = q
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?; // [nH, q_len, hd]
    let k_codes = Codes::read(&k.codes)?; // [kvh, keys, hd*kbits/32]
    let v_codes = Codes::read(&v.codes)?; // [kvh, keys, hd*vbits/32]
    let k_scales = groups_f32(&k.scales)?; // [kvh, keys, hd/kg]
    let k_biases = groups_f32(&k.biases)?; // [kvh, keys, hd/kg]
    let v_scales = groups_f32(&v.scales)?; // [kvh, keys, hd/vg]
    let v_biases = groups_f32(&v.biases)?; // [kvh, keys, hd/vg]

    let scale = plan.scale as f32;
    let mut out = vec![0f32; n_heads * q_len * head_dim]; // [nH, q_len, hd]
    let mut qs = vec![0f32; head_dim]; // [hd]: one scaled query row
    let mut q_sums = vec![0f32; k_groups]; // [hd/kg]: Σ q' per key group
    let mut acc = vec![0f32; head_dim]; // [hd]: running Σ p_j * v_j

    for h in 0..n_heads {
        let g = h / group; // KV head serving query head h
        for i in 0..q_len {
            let qpos = plan.q_offset + i;
            let q_row = &qf[(h * q_len + i) * head_dim..(h * q_len + i + 1) * head_dim];
            for (d, s) in qs.iter_mut().zip(q_row) {
                *d = s * scale;
            }
            for (gi, sum) in q_sums.iter_mut().enumerate() {
                *sum = qs[gi * kg..(gi + 1) * kg].iter().sum();
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let mut m = f32::NEG_INFINITY; // running max score
            let mut l = 0f32; // running Σ exp(s - m)
            for (j, &pos) in positions.iter().enumerate().take(keys) {
                if !visible(pos, qpos, plan.window) {
                    continue;
                }
                // Score against key j, dequantized group by group.
                let krow = k_codes.row(g, j);
                let kgi = (g * keys + j) * k_groups;
                let mut s = 0f32;
                for gi in 0..k_groups {
                    let mut dot = 0f32;
                    for e in gi * kg..(gi + 1) * kg {
                        dot += code_at(krow, e, kb) as f32 * qs[e];
                    }
                    s += k_scales[kgi + gi] * dot + k_biases[kgi + gi] * q_sums[gi];
                }
                // Online softmax: rescale what was accumulated when the max grows.
                let m_new = m.max(s);
                let corr = (m - m_new).exp();
                let p = (s - m_new).exp();
                l = l * corr + p;
                m = m_new;
                let vrow = v_codes.row(g, j);
                let vgi = (g * keys + j) * v_groups;
                for (e, a) in acc.iter_mut().enumerate() {
                    let gi = vgi + e / vg;
                    let val = v_scales[gi] * code_at(vrow, e, vb) as f32 + v_biases[gi];
                    *a = *a * corr + p * val;
                }
            }
            let o = &mut out[(h * q_len + i) * head_dim..(h * q_len + i + 1) * head_dim];
            // l > 0 whenever a key is visible; a query that sees nothing gets zeros, not NaN.
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for (d, a) in o.iter_mut().zip(&acc) {
                *d = a * inv;
            }
        }
    }
    let t = Tensor::from_vec(out, (1, n_heads, q_len, head_dim), &Device::Cpu)?
        .to_dtype(q.dtype())?
        .to_device(q.device())?;
    Ok(t)
}
