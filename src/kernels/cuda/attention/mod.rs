//! Fused attention over a cache view on CUDA: `plan` decides a sequence's kernel, rows a
//! block and key split; `launch` runs one sequence (the entry points behind
//! [`crate::kernels::attend`]); `batched` runs every sequence of a batch in one launch, and
//! the captured-step form a CUDA graph replays. Kernels: `attention.cu` (CUDA cores, split
//! combine) and `attention_tc.cu` (tensor cores); `prefill` runs long query blocks over dense
//! K/V with flash attention (`prefill_attention.cu`).

pub(crate) mod batched;
pub(crate) mod launch;
pub(crate) mod plan;
pub(crate) mod prefill;
