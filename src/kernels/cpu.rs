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
use crate::kernels::{KernelError, PackedAffine};

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
    fn read(codes: &Tensor) -> Result<Self, KernelError> {
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
fn groups_f32(t: &Tensor) -> Result<Vec<f32>, KernelError> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// One packed K or V of one sequence, ready to read.
struct Side {
    /// Packed codes `[kvh, keys, hd*bits/32]`.
    codes: Codes,
    /// `[kvh, keys, hd/group]`.
    scales: Vec<f32>,
    /// `[kvh, keys, hd/group]`.
    biases: Vec<f32>,
    bits: usize,
    group: usize,
    /// Groups per row (`hd / group`).
    groups: usize,
}

impl Side {
    fn read(p: &PackedAffine, head_dim: usize) -> Result<Self, KernelError> {
        Ok(Self {
            codes: Codes::read(&p.codes)?,
            scales: groups_f32(&p.scales)?,
            biases: groups_f32(&p.biases)?,
            bits: p.bits.bits(),
            group: p.group_size,
            groups: head_dim / p.group_size,
        })
    }
}

/// Everything one query head needs, shared read-only between threads.
struct Inputs<'a> {
    /// Queries `[nH, q_len, hd]`, f32.
    q: &'a [f32],
    k: &'a Side,
    v: &'a Side,
    positions: &'a [usize],
    plan: &'a QueryPlan,
    q_len: usize,
    head_dim: usize,
    keys: usize,
}

/// Quantized attention for one sequence.
///
/// `q`: `[1, n_heads, q_len, head_dim]`; `k`, `v`: packed `[1, kv_heads, keys, ...]`;
/// `positions[j]`: absolute position of key `j`. Returns `[1, n_heads, q_len, head_dim]` in
/// `q`'s dtype on `q`'s device. Query heads are spread over the available cores.
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &PackedAffine,
    v: &PackedAffine,
    positions: &[usize],
    plan: &QueryPlan,
) -> Result<Tensor, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.codes.dims4()?;
    let group = n_heads / kv_heads;
    let qf: Vec<f32> = q
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?; // [nH, q_len, hd]
    let (ks, vs) = (Side::read(k, head_dim)?, Side::read(v, head_dim)?);
    let inputs = Inputs {
        q: &qf,
        k: &ks,
        v: &vs,
        positions,
        plan,
        q_len,
        head_dim,
        keys,
    };

    let mut out = vec![0f32; n_heads * q_len * head_dim]; // [nH, q_len, hd]
    let per_head = (q_len * head_dim).max(1);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(n_heads)
        .max(1);
    let heads_per_thread = n_heads.div_ceil(threads);
    std::thread::scope(|scope| {
        for (t, chunk) in out.chunks_mut(per_head * heads_per_thread).enumerate() {
            let inputs = &inputs;
            scope.spawn(move || {
                for (i, out_h) in chunk.chunks_mut(per_head).enumerate() {
                    let h = t * heads_per_thread + i;
                    one_head(inputs, h, h / group, out_h);
                }
            });
        }
    });
    let t = Tensor::from_vec(out, (1, n_heads, q_len, head_dim), &Device::Cpu)?
        .to_dtype(q.dtype())?
        .to_device(q.device())?;
    Ok(t)
}

/// Query head `h` (served by KV head `g`) into `out` `[q_len, hd]`.
fn one_head(x: &Inputs<'_>, h: usize, g: usize, out: &mut [f32]) {
    let (hd, keys) = (x.head_dim, x.keys);
    let (k, v) = (x.k, x.v);
    let scale = x.plan.scale as f32;
    let mut qs = vec![0f32; hd]; // [hd]: one scaled query row
    let mut q_sums = vec![0f32; k.groups]; // [hd/kg]: Σ q' per key group
    let mut acc = vec![0f32; hd]; // [hd]: running Σ p_j * v_j
    for (i, o) in out.chunks_mut(hd).enumerate() {
        let qpos = x.plan.q_offset.saturating_add(i);
        let q_row = &x.q[(h * x.q_len + i) * hd..][..hd];
        for (d, s) in qs.iter_mut().zip(q_row) {
            *d = s * scale;
        }
        for (sum, chunk) in q_sums.iter_mut().zip(qs.chunks(k.group)) {
            *sum = chunk.iter().sum();
        }
        acc.iter_mut().for_each(|a| *a = 0.0);
        let mut m = f32::NEG_INFINITY; // running max score
        let mut l = 0f32; // running Σ exp(s - m)
        for (j, &pos) in x.positions.iter().enumerate().take(keys) {
            if !visible(pos, qpos, x.plan.window) {
                continue;
            }
            // Score against key j, dequantized group by group.
            let krow = k.codes.row(g, j);
            let kgi = (g * keys + j) * k.groups;
            let mut s = 0f32;
            for (gi, q_sum) in q_sums.iter().enumerate() {
                let mut dot = 0f32;
                for (e, qe) in qs.iter().enumerate().skip(gi * k.group).take(k.group) {
                    dot += code_at(krow, e, k.bits) as f32 * qe;
                }
                s += k.scales[kgi + gi] * dot + k.biases[kgi + gi] * q_sum;
            }
            // Online softmax: rescale what was accumulated when the max grows.
            let m_new = m.max(s);
            let corr = (m - m_new).exp();
            let p = (s - m_new).exp();
            l = l * corr + p;
            m = m_new;
            let vrow = v.codes.row(g, j);
            let vgi = (g * keys + j) * v.groups;
            for (e, a) in acc.iter_mut().enumerate() {
                let gi = vgi + e / v.group;
                let val = v.scales[gi] * code_at(vrow, e, v.bits) as f32 + v.biases[gi];
                *a = *a * corr + p * val;
            }
        }
        // l > 0 whenever a key is visible; a query that sees nothing gets zeros, not NaN.
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        for (d, a) in o.iter_mut().zip(&acc) {
            *d = a * inv;
        }
    }
}

/// One token's MoE routing from its router logits: the `top_k` largest in `f32::total_cmp`
/// order (ties to the lower expert), each weighted by the softmax over the picks times
/// `per_expert_scale[expert]`, in pick order. The reference the Metal routing kernel is tested
/// against, and what the host routing computes.
pub fn moe_route_row(row: &[f32], top_k: usize, per_expert_scale: &[f32]) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    let max = idx.first().map_or(0.0, |&i| row[i]);
    let exps: Vec<f32> = idx.iter().map(|&i| (row[i] - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    idx.iter()
        .zip(exps)
        .map(|(&e, w)| (e, w / sum * per_expert_scale[e]))
        .collect()
}
