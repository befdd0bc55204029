//! Attention over dense K/V with candle ops (any device): grouped-query matmuls, softmax in f32,
//! a position mask built only when some key is hidden from some query.

use candle_core::{DType, Tensor};

use super::{visible, QueryPlan};
use crate::kernels::KernelError;

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
) -> Result<Tensor, KernelError> {
    let (_, n_heads, q_len, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.dims4()?;
    let group = n_heads / kv_heads;
    // GQA without repeat_kv: the `group` query heads of one KV head become extra rows.
    let qg = q.reshape((kv_heads, group * q_len, head_dim))?; // [kvh, group*q_len, hd]
    let kk = k.squeeze(0)?; // [kvh, keys, hd]
    let vv = v.squeeze(0)?; // [kvh, keys, hd]
    let scores = matmul_strided(&qg, &kk.t()?)?; // [kvh, group*q_len, keys]
    let probs = if super::ops::fused(q.device()) {
        fused_softmax(&scores, positions, plan, q_len)?
    } else {
        softmax(scores, positions, plan, (kv_heads, group, q_len, keys))?
    }
    .to_dtype(vv.dtype())?; // [kvh, group*q_len, keys]
    let out = matmul_strided(&probs, &vv)?; // [kvh, group*q_len, hd]
    Ok(out
        .reshape((1, n_heads, q_len, head_dim))?
        .to_dtype(q.dtype())?)
}

/// Mask, scale and softmax in one CUDA kernel, in the scores' dtype.
#[cfg(feature = "cuda")]
fn fused_softmax(
    scores: &Tensor,
    positions: &[usize],
    plan: &QueryPlan,
    q_len: usize,
) -> Result<Tensor, KernelError> {
    Ok(crate::kernels::cuda::reduce::masked_softmax(
        scores,
        positions,
        plan.q_offset,
        q_len,
        plan.window,
        plan.scale,
    )?)
}

#[cfg(not(feature = "cuda"))]
fn fused_softmax(
    scores: &Tensor,
    positions: &[usize],
    plan: &QueryPlan,
    q_len: usize,
) -> Result<Tensor, KernelError> {
    let (kvh, rows, keys) = scores.dims3()?;
    softmax(
        scores.clone(),
        positions,
        plan,
        (kvh, rows / q_len.max(1), q_len, keys),
    )
}

/// Scale, mask and softmax with candle ops, in f32: `scores` `[kvh, group * q_len, keys]`.
fn softmax(
    scores: Tensor,
    positions: &[usize],
    plan: &QueryPlan,
    (kv_heads, group, q_len, keys): (usize, usize, usize, usize),
) -> Result<Tensor, KernelError> {
    let scores = scores.to_dtype(DType::F32)?;
    let scores = if plan.scale == 1.0 {
        scores
    } else {
        (scores * plan.scale)?
    };
    let scores = match mask(positions, plan, q_len)? {
        None => scores,
        Some(mask) => {
            let mask = on_device(mask, scores.device())?; // [q_len, keys]
            scores
                .reshape((kv_heads, group, q_len, keys))?
                .broadcast_add(&mask)?
                .reshape((kv_heads, group * q_len, keys))?
        }
    };
    Ok(candle_nn::ops::softmax_last_dim(&scores)?)
}

/// A mask key: every layer of one kind sees the same key positions in one forward, so the
/// mask is built and uploaded once per forward and kind, not once per layer.
type MaskKey = (u64, usize, usize, usize, Option<usize>, String);

thread_local! {
    /// The last few masks, on their device.
    static MASKS: std::cell::RefCell<Vec<(MaskKey, Tensor)>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn positions_hash(positions: &[usize]) -> u64 {
    positions.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &p| {
        (h ^ p as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Moves a host mask to `device`, reusing an identical one uploaded earlier on this thread.
fn on_device(mask: HostMask, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let key = (
        mask.hash,
        mask.positions.len(),
        mask.q_offset,
        mask.q_len,
        mask.window,
        format!("{:?}", device.location()),
    );
    if let Some(t) = MASKS.with(|m| {
        m.borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, t)| t.clone())
    }) {
        return Ok(t);
    }
    let t = if device.is_cpu() {
        mask.build()?
    } else {
        mask.build_on(device)?
    };
    MASKS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= 4 {
            m.remove(0);
        }
        m.push((key, t.clone()));
    });
    Ok(t)
}

/// `a · b`, reading a cache view in place when the backend accepts its strides (a narrowed
/// buffer is strided along heads) and copying it to contiguous memory only when it does not.
fn matmul_strided(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match a.matmul(b) {
        Ok(out) => Ok(out),
        Err(_) => a.contiguous()?.matmul(&b.contiguous()?),
    }
}

/// The additive mask `[q_len, keys]` (0 visible, -inf hidden), described but not yet built,
/// or `None` when every key is visible to every query (a 1-token decode over a ring that holds
/// exactly the window): then the kernel runs without a mask, the same path whatever the batch.
fn mask<'a>(
    positions: &'a [usize],
    plan: &QueryPlan,
    q_len: usize,
) -> Result<Option<HostMask<'a>>, KernelError> {
    let first_q = plan.q_offset;
    let last_q = plan.q_offset.saturating_add(q_len.saturating_sub(1));
    let all_visible = positions
        .iter()
        .all(|&p| visible(p, first_q, plan.window) && visible(p, last_q, plan.window));
    if all_visible {
        return Ok(None);
    }
    Ok(Some(HostMask {
        positions,
        hash: positions_hash(positions),
        q_offset: plan.q_offset,
        q_len,
        window: plan.window,
    }))
}

/// What a mask depends on.
struct HostMask<'a> {
    positions: &'a [usize],
    hash: u64,
    q_offset: usize,
    q_len: usize,
    window: Option<usize>,
}

impl HostMask<'_> {
    /// Builds the mask on `device` from the key positions (a `keys`-long upload instead of a
    /// `q_len x keys` one, and no host loop over every pair).
    fn build_on(&self, device: &candle_core::Device) -> candle_core::Result<Tensor> {
        let keys = self.positions.len();
        let to_u32 = |x: usize| {
            u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("position {x} > u32")))
        };
        let kpos: Vec<u32> = self
            .positions
            .iter()
            .map(|&p| to_u32(p))
            .collect::<candle_core::Result<_>>()?;
        let kpos = Tensor::from_vec(kpos, (1, keys), device)?;
        let first = to_u32(self.q_offset)?;
        let qpos =
            Tensor::arange(first, first + to_u32(self.q_len)?, device)?.reshape((self.q_len, 1))?;
        let mut visible = kpos.broadcast_le(&qpos)?; // [q_len, keys] u8
        if let Some(w) = self.window {
            // key + W > query
            let shifted = (kpos.to_dtype(DType::F32)? + w as f64)?;
            let inside = shifted.broadcast_gt(&qpos.to_dtype(DType::F32)?)?;
            visible = (visible * inside)?;
        }
        let zero = Tensor::zeros(1, DType::F32, device)?.broadcast_as((self.q_len, keys))?;
        let hidden =
            Tensor::full(f32::NEG_INFINITY, 1, device)?.broadcast_as((self.q_len, keys))?;
        visible.where_cond(&zero, &hidden)
    }

    fn build(&self) -> candle_core::Result<Tensor> {
        let mut m = Vec::with_capacity(self.q_len * self.positions.len()); // [q_len, keys]
        for i in 0..self.q_len {
            let qpos = self.q_offset.saturating_add(i);
            m.extend(self.positions.iter().map(|&p| {
                if visible(p, qpos, self.window) {
                    0f32
                } else {
                    f32::NEG_INFINITY
                }
            }));
        }
        Tensor::from_vec(
            m,
            (self.q_len, self.positions.len()),
            &candle_core::Device::Cpu,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_mask_equals_host_mask() {
        let dev = candle_core::Device::Cpu;
        let positions: Vec<usize> = (20..40).chain(5..20).collect();
        let mut hidden = 0;
        for window in [None, Some(4), Some(16)] {
            for (q_offset, q_len) in [(30, 10), (39, 1), (35, 5)] {
                let m = HostMask {
                    positions: &positions,
                    hash: 0,
                    q_offset,
                    q_len,
                    window,
                };
                let host = m.build().unwrap().to_vec2::<f32>().unwrap();
                let device = m.build_on(&dev).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(host, device, "window {window:?}, q {q_offset}+{q_len}");
                hidden += host.iter().flatten().filter(|x| x.is_infinite()).count();
            }
        }
        assert!(hidden > 0);
    }
}
