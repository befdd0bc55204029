//! Build script: compiles each CUDA kernel file `src/kernels/cuda/{name}.cu` (one per concept,
//! see [`MODULES`]) to a fatbin with `nvcc` when the `cuda` feature is on: machine code for
//! `CUDA_COMPUTE_CAP` plus PTX for newer GPUs. Without the feature, nothing is built and no
//! CUDA toolkit is needed. The fatbins are embedded and loaded by
//! `src/kernels/cuda/kernel_cache.rs`.
//!
//! Machine code rather than PTX alone: the driver would otherwise compile ~28 MB of PTX at the
//! first launch of each module on every new machine, about a minute before the first token.
//!
//! Environment: `NVCC` (the compiler; else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on `PATH`) and
//! `CUDA_COMPUTE_CAP` (e.g. `90` for H100/H200; default 90).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel files, one module each (`Module` constants in `kernel_cache.rs`).
const MODULES: [&str; 13] = [
    "attention",
    "attention_tc",
    "matvec",
    "matvec_batch",
    "quantize",
    "layer_ops",
    "moe",
    "reduce",
    "prefill_attention",
    "dense_matvec",
    "diagnostics",
    "peer_reduce",
    "top_k",
];

/// Device code the kernel files include.
const HEADERS: [&str; 11] = [
    "async_copy.cuh",
    "gate.cuh",
    "common.cuh",
    "packed.cuh",
    "attention.cuh",
    "qsdpa_tc.cuh",
    "norm_tail.cuh",
    "peer.cuh",
    "moe_tc.cuh",
    "wgmma.cuh",
    "draw.cuh",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for file in MODULES
        .iter()
        .map(|m| format!("{m}.cu"))
        .chain(HEADERS.iter().map(|h| h.to_string()))
    {
        println!("cargo:rerun-if-changed=src/kernels/cuda/{file}");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDARC_CUDA_VERSION");
    println!("cargo:rustc-check-cfg=cfg(cublas_grouped_gemm)");
    println!("cargo:rustc-check-cfg=cfg(prefill_wgmma)");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    // cuBLAS's grouped products (`cublasGemmGroupedBatchedEx`) came with CUDA 12.5; cudarc
    // declares them only when it was built for such a toolkit, which it finds the same way.
    if cuda_release().is_some_and(|v| v >= (12, 5)) {
        println!("cargo:rustc-cfg=cublas_grouped_gemm");
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let nvcc = std::env::var("NVCC")
        .ok()
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"]
                .iter()
                .filter_map(std::env::var_os)
                .map(|root| PathBuf::from(root).join("bin").join("nvcc"))
                .find(|p| p.exists())
                .unwrap_or_else(|| PathBuf::from("nvcc"))
        });
    println!("cargo:rustc-env=CANDLE_GEMMA_CUDA_CAP={cap}");
    // Built for compute capability 9.0, the prefill kernel's warpgroup-product forms exist
    // (machine code for sm_90a; see `compile`).
    if cap == "90" {
        println!("cargo:rustc-cfg=prefill_wgmma");
    }
    // Every module at once: compiling them to machine code is most of the build's time.
    let jobs: Vec<_> = MODULES
        .into_iter()
        .map(|name| {
            let (nvcc, out_dir, cap) = (nvcc.clone(), out_dir.clone(), cap.clone());
            std::thread::spawn(move || compile(&nvcc, &out_dir, &cap, name))
        })
        .collect();
    for job in jobs {
        if let Err(msg) = job
            .join()
            .unwrap_or_else(|_| Err("nvcc thread panicked".into()))
        {
            panic!("{msg}");
        }
    }
}

/// The CUDA toolkit's `(major, minor)` as cudarc reads it: `CUDARC_CUDA_VERSION` (`12050`),
/// else the `release X.Y` of `nvcc --version`.
fn cuda_release() -> Option<(u32, u32)> {
    if let Ok(v) = std::env::var("CUDARC_CUDA_VERSION") {
        let n: u32 = v.trim().parse().ok()?;
        return Some((n / 1000, n % 1000 / 10));
    }
    let out = Command::new("nvcc").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text.split("release ").nth(1)?;
    let number = release
        .split(|c: char| c == ',' || c.is_whitespace())
        .next()?;
    let (major, minor) = number.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Compiles `src/kernels/cuda/{name}.cu` into `{out_dir}/{name}.fatbin`: machine code for
/// compute capability `cap` (no JIT compilation when the module loads on such a GPU) and its
/// PTX (which the driver compiles for newer GPUs). The prefill attention's machine code for
/// 9.0 targets sm_90a, whose warpgroup products (`wgmma`) run on 9.0 devices only; its PTX
/// stays plain compute_90, without them.
fn compile(nvcc: &Path, out_dir: &Path, cap: &str, name: &str) -> Result<(), String> {
    let src = format!("src/kernels/cuda/{name}.cu");
    let sass = if cap == "90" && name == "prefill_attention" {
        "90a"
    } else {
        cap
    };
    let status = Command::new(nvcc)
        .args(["--fatbin", "-O3", "-std=c++17"])
        .arg(format!("-gencode=arch=compute_{sass},code=sm_{sass}"))
        .arg(format!("-gencode=arch=compute_{cap},code=compute_{cap}"))
        .arg("-o")
        .arg(out_dir.join(format!("{name}.fatbin")))
        .arg(&src)
        .status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("nvcc failed ({s}) compiling {src}")),
        Err(e) => Err(format!(
            "cannot run {} ({e}): the `cuda` feature needs nvcc (set NVCC or CUDA_ROOT)",
            nvcc.display()
        )),
    }
}
