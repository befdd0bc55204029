//! Attention over dense K/V with candle ops (any device): grouped-query matmuls, softmax in f32,
//! a position mask built only when some key is hidden from some query.

use candle_core::{DType, Tensor};

use super::{visible, QueryPlan};
use crate::kv::CacheError;

/// Dense attention for one sequence.
///
/// `q`: `[1, n_heads, q_len, head_dim]`; `k`, `v`: `[1, kv_heads, keys, head_dim]`;
/// `positions[j]`: absolute position of key `j`. Returns `[1, n_heads, q_len, head_dim]` in
/// `q`'s dtype.
pub(crate) fn attend_dense(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &[usize],
    plan: &QueryPlan,
) -> Result<Tensor, CacheError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.dims4()?;
    let group = n_heads / kv_heads;
    // GQA without repeat_kv: the `group` query heads of one KV head become extra rows.
    let qg = q.reshape((kv_heads, group * q_len, head_dim))?; // [kvh, group*q_len, hd]
    let kk = k.squeeze(0)?; // [kvh, keys, hd]
    let vv = v.squeeze(0)?; // [kvh, keys, hd]
    let scores = matmul_strided(&qg, &kk.t()?)?.to_dtype(DType::F32)?; // [kvh, group*q_len, keys]
    let scores = (scores * plan.scale)?;
    let scores = match mask(positions, plan, q_len)? {
        None => scores,
        Some(mask) => {
            let mask = mask.to_device(scores.device())?; // [q_len, keys]
            scores
                .reshape((kv_heads, group, q_len, keys))?
                .broadcast_add(&mask)?
                .reshape((kv_heads, group * q_len, keys))?
        }
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(vv.dtype())?; // [kvh, group*q_len, keys]
    let out = matmul_strided(&probs, &vv)?; // [kvh, group*q_len, hd]
    Ok(out
        .reshape((1, n_heads, q_len, head_dim))?
        .to_dtype(q.dtype())?)
}

/// `a · b`, reading a cache view in place when the backend accepts its strides (a narrowed
/// buffer is strided along heads) and copying it to contiguous memory only when it does not.
fn matmul_strided(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match a.matmul(b) {
        Ok(out) => Ok(out),
        Err(_) => a.contiguous()?.matmul(&b.contiguous()?),
    }
}

/// The additive mask `[q_len, keys]` (0 visible, -inf hidden), or `None` when every key is
/// visible to every query (a 1-token decode over a ring that holds exactly the window): then
/// the kernel runs without a mask, the same path whatever the batch.
fn mask(positions: &[usize], plan: &QueryPlan, q_len: usize) -> Result<Option<Tensor>, CacheError> {
    let first_q = plan.q_offset;
    let last_q = plan.q_offset.saturating_add(q_len.saturating_sub(1));
    let all_visible = positions
        .iter()
        .all(|&p| visible(p, first_q, plan.window) && visible(p, last_q, plan.window));
    if all_visible {
        return Ok(None);
    }
    let mut m = Vec::with_capacity(q_len * positions.len()); // [q_len, keys]
    for i in 0..q_len {
        let qpos = plan.q_offset.saturating_add(i);
        m.extend(positions.iter().map(|&p| {
            if visible(p, qpos, plan.window) {
                0f32
            } else {
                f32::NEG_INFINITY
            }
        }));
    }
    Ok(Some(Tensor::from_vec(
        m,
        (q_len, positions.len()),
        &candle_core::Device::Cpu,
    )?))
}
