//! Build script: compiles the CUDA kernels (`src/kernels/cuda/qkernels.cu`, the quantized ones, and
//! `src/kernels/cuda/fused.cu`, the fused decoder-layer ones) to PTX with `nvcc` when the `cuda`
//! feature is on. Without it, nothing is built and no CUDA toolkit is
//! needed. The PTX is embedded by `src/kernels/cuda/launch.rs` and loaded at run time by candle's
//! CUDA device.
//!
//! Environment: `NVCC` (the compiler; else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on `PATH`) and
//! `CUDA_COMPUTE_CAP` (e.g. `90` for H100/H200; default 90).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/kernels/cuda/qkernels.cu");
    println!("cargo:rerun-if-changed=src/kernels/cuda/fused.cu");
    println!("cargo:rerun-if-changed=src/kernels/cuda/common.cuh");
    println!("cargo:rerun-if-changed=src/kernels/cuda/qsdpa_tc.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
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
    for name in ["qkernels", "fused"] {
        let src = format!("src/kernels/cuda/{name}.cu");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(&src)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("nvcc failed ({s}) compiling {src}"),
            Err(e) => panic!(
                "cannot run {} ({e}): the `cuda` feature needs nvcc (set NVCC or CUDA_ROOT)",
                nvcc.display()
            ),
        }
    }
}
