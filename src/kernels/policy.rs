//! Launch policy: every tuning switch of the kernels, as one value.
//!
//! [`LaunchPolicy::default`] is what the crate ships. [`LaunchPolicy::from_env`] applies the
//! few documented environment overrides on top; this module is the only place in the crate
//! that reads the environment. [`crate::ModelBuilder::launch_policy`] sets it (else
//! `from_env`); the first model built installs it for the process ([`install`]), and the
//! kernels read it through [`current`].
//!
//! | variable | field | effect |
//! |---|---|---|
//! | `CANDLE_GEMMA_UNFUSED=1` | [`LaunchPolicy::fused`] | candle op chains instead of the fused CUDA kernels |
//! | `CANDLE_GEMMA_CUDA_GRAPH=0` | [`LaunchPolicy::cuda_graph`] | no CUDA graph replay for decode |
//! | `CANDLE_GEMMA_PDL=0` | [`LaunchPolicy::dependent_launch`] | plain launches (no programmatic dependent launch) |
//! | `CANDLE_GEMMA_EARLY_LOADS=0` | [`LaunchPolicy::early_loads`] | no loads of settled weights or keys before the dependent-launch wait |
//! | `CANDLE_GEMMA_FLASH_PREFILL=0` | [`LaunchPolicy::flash_prefill`] | prefill attention through the score matrix (cuBLAS products and a masked softmax) |
//! | `CANDLE_GEMMA_PREFILL_WGMMA=0` | [`LaunchPolicy::prefill_wgmma`] | the flash prefill kernel's `mma.sync` form on compute capability 9.0 too |
//! | `CANDLE_GEMMA_PREFILL_CHUNK=N` | [`LaunchPolicy::prefill_chunk`] | longest run of prompt tokens one forward pass takes at once (0: by device) |
//! | `CANDLE_GEMMA_MOE_PADDED_MAX_PCT=N` | [`LaunchPolicy::moe_padded_max_pct`] | MoE prefill: largest padded size, in percent of the routed pairs, that still runs as one padded batched product |
//! | `CANDLE_GEMMA_MOE_TC_MIN_PAIRS=N` | [`LaunchPolicy::moe_tc_min_pairs`] | MoE decode, 4-bit experts: fewest routed pairs from which the expert products run on the tensor cores (0: never) |
//! | `CANDLE_GEMMA_MOE_TC_MIN_PAIRS_DENSE=N` | [`LaunchPolicy::moe_tc_min_pairs_dense`] | the same for dense experts |
//! | `CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=N` | [`LaunchPolicy::moe_grouped_max_tokens`] | token count up to which MoE runs the grouped matvec |
//! | `CANDLE_GEMMA_PEER_ALL_REDUCE_MAX_BYTES=N` | [`LaunchPolicy::peer_all_reduce_max_bytes`] | largest tensor-parallel sum that runs the crate's peer-memory kernel (0: NCCL for every sum) |
//! | `CANDLE_GEMMA_METAL_KERNELS=0` | [`LaunchPolicy::metal_kernels`] | no crate Metal kernels (the host fallback) |

use std::sync::OnceLock;

/// Every tuning switch of the kernels. `Copy`, so callers pass it by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchPolicy {
    /// Fused CUDA kernels for add-norm, GeGLU, qkv-prep, MoE and matvec (on by default); off
    /// runs the candle op chains they replace, which is the reference they are tested against.
    pub fused: bool,
    /// Replay decode steps as CUDA graphs (one a batch size) where every layer's cache allows
    /// it.
    pub cuda_graph: bool,
    /// Most sequences a decode step may have and still replay a graph (default 64; 1 keeps
    /// graphs to single-sequence decode). Each new batch size costs one eager step and one
    /// capture (tens of milliseconds for a large model) the first time it is seen, which a
    /// latency-bound server whose batch size changes often may prefer to avoid.
    pub cuda_graph_max_batch: usize,
    /// Let a kernel launch before its predecessor finishes (`griddepcontrol`, compute 9.0+).
    pub dependent_launch: bool,
    /// With dependent launches, let kernels issue their first loads of settled weights and keys
    /// (data no running kernel writes) before waiting for the kernel ahead (on by default). Off,
    /// every load waits; a check of that ordering.
    pub early_loads: bool,
    /// Run long query blocks (prefill) over f16/bf16 K/V through the crate's flash-attention
    /// kernel on CUDA (on by default). Off, they take the cuBLAS score matrix and the masked
    /// softmax, which the kernel is tested against.
    pub flash_prefill: bool,
    /// On compute capability 9.0 (H100, H200), with the crate built for it, run the flash
    /// prefill kernel's form on the warpgroup products (`wgmma`) at head dims 256 and 512 (on
    /// by default); off, or elsewhere, its `mma.sync` form.
    pub prefill_wgmma: bool,
    /// Longest run of prompt tokens one forward pass takes at once; longer prompts run as
    /// consecutive chunks. 0 (the default) picks by device: [`crate::PREFILL_CHUNK_FLASH`] where
    /// prefill attention takes the flash kernel (CUDA, f16/bf16, [`Self::flash_prefill`] on),
    /// else [`crate::PREFILL_CHUNK`]. Longer chunks read every weight fewer times per prompt
    /// (an MoE layer's experts above all); shorter ones keep score matrices small.
    pub prefill_chunk: usize,
    /// Up to this many tokens an MoE layer runs the grouped matrix-vector kernel; above it, the
    /// sorted tensor-core path (0 sends every forward through the sorted path).
    pub moe_grouped_max_tokens: usize,
    /// MoE prefill over dense (or wholly dequantized) experts: where every expert's group of
    /// rows padded to the longest group comes to at most this percent of the routed pairs, both
    /// expert products run as one padded batched product (cuBLAS's strided batched GEMM, faster
    /// per row); above it, as grouped products with no padding where cuBLAS has them (CUDA
    /// 12.5+). 0 sends every prefill through the grouped products.
    pub moe_padded_max_pct: usize,
    /// MoE decode over 4-bit experts with 16-bit activations: from this many routed (token,
    /// pick) pairs a call (default 64: batch 8 of a model picking 8), the grouped expert
    /// products dequantize each code to a 16-bit fragment once for up to 32 of its expert's
    /// pairs and multiply on the tensor cores; below, the CUDA cores decode each code once for
    /// up to four pairs (once a pair for the fewest). At batch 2-4 with every pick a different
    /// expert the tensor-core form measured 0.94-0.95x (26B-A4B, one H100), from batch 8 on
    /// 1.06-1.85x. 0 keeps every call on the CUDA cores.
    pub moe_tc_min_pairs: usize,
    /// As [`Self::moe_tc_min_pairs`] for dense (16-bit) experts, whose CUDA-core product reads
    /// each weight once a pair; default 256 (batch 32 of a model picking 8): below it the
    /// tensor-core form measured slower (26B-A4B bf16, one H100: 0.85-0.93x at batch 2-16,
    /// 1.02-1.07x at 32, 1.34-1.39x at 64).
    pub moe_tc_min_pairs_dense: usize,
    /// Tensor-parallel sums (all-reduces) of up to this many bytes run the crate's one-shot
    /// kernel over peer memory (NVLink) instead of NCCL, where every pair of the group's GPUs
    /// can reach each other's memory: a decode step's sums are small, and NCCL's latency is
    /// most of their cost. Each GPU holds a stage buffer of twice this size. 0 sends every sum
    /// through NCCL. Default 1 MiB.
    pub peer_all_reduce_max_bytes: usize,
    /// Use the crate's own Metal kernels for packed K/V and weights (on by default; off, packed
    /// products and K/V fall back to the dequantize-on-host path).
    pub metal_kernels: bool,
    /// Give exactly-mapped 4-bit matrices their candle `Q4_1` blocks on the CPU too (always on
    /// Metal): products of up to 8 rows then multiply by candle's dequantization of the blocks,
    /// and row gathers use candle's `Q4_1` gather. Off by default (the crate's reference is
    /// faster there); tests turn it on to run the fixtures through the blocks end to end.
    #[doc(hidden)]
    pub candle_q4_1_on_cpu: bool,
    /// Run every product of the CPU's `Q4_1` blocks (any number of rows, MoE expert rows
    /// included) on candle's own CPU quantized matmul (`QMatMul`), which rounds each block of
    /// activations to 8 bits (`Q8_1`) before the integer dot products; implies
    /// [`LaunchPolicy::candle_q4_1_on_cpu`]. Off by default and never a shipped path: tests
    /// turn it on to measure the fixtures through candle's CPU kernel
    /// (`tests/q4_1_candle_matmul.rs`).
    #[doc(hidden)]
    pub candle_qmatmul_on_cpu: bool,
    /// A benchmark switch, never for inference: on CUDA, replace every MoE layer's picks with
    /// picks spread evenly over the experts (the mix weights stay the router's). Random-weight
    /// models route most tokens to a few experts; this measures the expert products under the
    /// load of a spread routing, as a trained router gives. The output is not the model's.
    #[doc(hidden)]
    pub bench_spread_routing: bool,
}

impl Default for LaunchPolicy {
    fn default() -> Self {
        Self {
            fused: true,
            cuda_graph: true,
            cuda_graph_max_batch: 64,
            dependent_launch: true,
            early_loads: true,
            flash_prefill: true,
            prefill_wgmma: true,
            prefill_chunk: 0,
            moe_grouped_max_tokens: 64,
            moe_padded_max_pct: 150,
            moe_tc_min_pairs: 64,
            moe_tc_min_pairs_dense: 256,
            peer_all_reduce_max_bytes: 1 << 20,
            metal_kernels: true,
            candle_q4_1_on_cpu: false,
            candle_qmatmul_on_cpu: false,
            bench_spread_routing: false,
        }
    }
}

impl LaunchPolicy {
    /// Puts this policy in force for the process, as [`crate::ModelBuilder::launch_policy`]
    /// does at build: for models made without the builder ([`crate::Model::random`]). The
    /// first policy installed stays; returns whether it is this one.
    pub fn install(self) -> bool {
        install(self)
    }

    /// The defaults with the environment overrides in the module table applied. Values that do
    /// not parse leave the default in place.
    pub fn from_env() -> Self {
        // A count from the environment, where set and parsable.
        let count = |name: &str| std::env::var(name).ok()?.parse::<usize>().ok();
        let mut p = Self::default();
        if let Ok(v) = std::env::var("CANDLE_GEMMA_UNFUSED") {
            p.fused = v.is_empty() || v == "0";
        }
        if let Ok(v) = std::env::var("CANDLE_GEMMA_CUDA_GRAPH") {
            p.cuda_graph = v != "0";
        }
        if let Ok(v) = std::env::var("CANDLE_GEMMA_PDL") {
            p.dependent_launch = v != "0";
        }
        if let Ok(v) = std::env::var("CANDLE_GEMMA_EARLY_LOADS") {
            p.early_loads = v != "0";
        }
        if let Ok(v) = std::env::var("CANDLE_GEMMA_FLASH_PREFILL") {
            p.flash_prefill = v != "0";
        }
        if let Ok(v) = std::env::var("CANDLE_GEMMA_PREFILL_WGMMA") {
            p.prefill_wgmma = v != "0";
        }
        p.prefill_chunk = count("CANDLE_GEMMA_PREFILL_CHUNK").unwrap_or(p.prefill_chunk);
        p.moe_grouped_max_tokens =
            count("CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS").unwrap_or(p.moe_grouped_max_tokens);
        p.moe_padded_max_pct =
            count("CANDLE_GEMMA_MOE_PADDED_MAX_PCT").unwrap_or(p.moe_padded_max_pct);
        p.moe_tc_min_pairs = count("CANDLE_GEMMA_MOE_TC_MIN_PAIRS").unwrap_or(p.moe_tc_min_pairs);
        p.moe_tc_min_pairs_dense =
            count("CANDLE_GEMMA_MOE_TC_MIN_PAIRS_DENSE").unwrap_or(p.moe_tc_min_pairs_dense);
        p.peer_all_reduce_max_bytes =
            count("CANDLE_GEMMA_PEER_ALL_REDUCE_MAX_BYTES").unwrap_or(p.peer_all_reduce_max_bytes);
        if let Ok(v) = std::env::var("CANDLE_GEMMA_METAL_KERNELS") {
            p.metal_kernels = v != "0";
        }
        p
    }
}

static CURRENT: OnceLock<LaunchPolicy> = OnceLock::new();

/// Sets the process's policy. The first call wins (kernels cache launch decisions, so the policy
/// cannot change under them); returns whether this call's policy is the one in force.
pub fn install(policy: LaunchPolicy) -> bool {
    *CURRENT.get_or_init(|| policy) == policy
}

/// The policy in force: the installed one, else [`LaunchPolicy::from_env`] resolved once.
pub fn current() -> LaunchPolicy {
    *CURRENT.get_or_init(LaunchPolicy::from_env)
}
