//! The emulator: `emulate.cpp`, `qkernels.metal` and the shim compiled as C++20 into one binary
//! (once per source version), and the job files that drive it (buffers in, dispatches of the
//! launch plans, a buffer out).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{DType, Device, Storage, Tensor};

/// The emulator binary, built once per source version (kept in the temp dir, keyed by a hash
/// of the sources and the compiler) and found once per test process; `None` when no compiler
/// is found.
pub fn emulator() -> Option<&'static Path> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT.get_or_init(build_emulator).as_deref()
}

fn build_emulator() -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let sources = [
        (
            "metal_stdlib",
            include_str!("../../src/kernels/metal/shim.h"),
        ),
        ("qkernels.metal", candle_gemma::kernels::metal::SOURCE),
        ("emulate.cpp", include_str!("emulate.cpp")),
    ];
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&cxx, &sources).hash(&mut hasher);
    let dir = std::env::temp_dir().join(format!("candle-gemma-metal-emu-{:016x}", hasher.finish()));
    let bin = dir.join("emulate");
    if bin.is_file() {
        return Some(bin);
    }
    std::fs::create_dir_all(&dir).expect("emulator dir");
    for (name, text) in sources {
        std::fs::write(dir.join(name), text).expect("write emulator source");
    }
    // Built under a name of this process, then renamed: concurrent test runs never see half a
    // binary.
    let partial = dir.join(format!("emulate.{}", std::process::id()));
    let out = match Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-Wno-attributes", "-pthread", "-I"])
        .arg(&dir)
        .arg("-o")
        .arg(&partial)
        .arg(dir.join("emulate.cpp"))
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            let required = std::env::var("CANDLE_GEMMA_REQUIRE_METAL_EMU").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "no C++ compiler `{cxx}` for the Metal emulation: {e}"
            );
            eprintln!("Metal emulation skipped: no C++ compiler `{cxx}` ({e})");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "building the Metal emulator with `{cxx}` failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&partial, &bin).expect("install the emulator");
    Some(bin)
}

/// The raw bytes of a CPU tensor's whole storage and the byte offset of its layout's start.
fn storage_bytes(t: &Tensor) -> (Vec<u8>, usize) {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        panic!("expected a CPU tensor")
    };
    fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
        // SAFETY: plain numbers, read as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
            .to_vec()
    }
    use candle_core::CpuStorage as C;
    let raw = match cpu {
        C::U32(v) => bytes(v),
        C::F32(v) => bytes(v),
        C::F16(v) => bytes(v),
        C::BF16(v) => bytes(v),
        _ => panic!("unexpected storage dtype {:?}", t.dtype()),
    };
    (raw, layout.start_offset() * t.dtype().size_in_bytes())
}

pub fn pod_bytes<T: Copy>(x: &T) -> Vec<u8> {
    // SAFETY: a `#[repr(C)]` parameter block of plain numbers.
    unsafe { std::slice::from_raw_parts((x as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

/// A job file for the emulator, with its buffers written next to it.
pub struct Job {
    dir: PathBuf,
    lines: Vec<String>,
    files: usize,
}

impl Job {
    pub fn new(name: &str) -> Self {
        static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "candle-gemma-metal-job-{}-{n}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("job dir");
        Self {
            dir,
            lines: Vec::new(),
            files: 0,
        }
    }

    pub fn load(&mut self, name: &str, bytes: &[u8]) {
        self.files += 1;
        let file = self.dir.join(format!("in{}.bin", self.files));
        std::fs::write(&file, bytes).expect("write input");
        self.lines.push(format!("load {name} {}", file.display()));
    }

    /// Loads a tensor's storage as buffer `name`; returns the byte offset to bind it at.
    pub fn tensor(&mut self, name: &str, t: &Tensor) -> usize {
        let (bytes, offset) = storage_bytes(t);
        self.load(name, &bytes);
        offset
    }

    pub fn alloc(&mut self, name: &str, bytes: usize) {
        self.lines.push(format!("alloc {name} {bytes}"));
    }

    pub fn dispatch(
        &mut self,
        kernel: &str,
        groups: [usize; 3],
        threads: usize,
        binds: &[(usize, &str, usize)],
    ) {
        self.lines.push(format!(
            "dispatch {kernel} {} {} {} {threads}",
            groups[0], groups[1], groups[2]
        ));
        for (index, name, offset) in binds {
            self.lines.push(format!("bind {index} {name} {offset}"));
        }
        self.lines.push("run".into());
    }

    /// Runs the job and returns buffer `name` as a tensor of `dims` in `dtype`.
    #[allow(dead_code)] // not every test file that includes the emulator calls it
    pub fn run(self, emulator: &Path, name: &str, dtype: DType, dims: &[usize]) -> Tensor {
        self.run_many(emulator, &[(name, dtype, dims)])
            .pop()
            .expect("one output")
    }

    /// Runs the job and returns each `(buffer, dtype, dims)` of `outputs` as a tensor.
    pub fn run_many(mut self, emulator: &Path, outputs: &[(&str, DType, &[usize])]) -> Vec<Tensor> {
        for (i, (name, _, _)) in outputs.iter().enumerate() {
            let out = self.dir.join(format!("out{i}.bin"));
            self.lines.push(format!("save {name} {}", out.display()));
        }
        let job = self.dir.join("job.txt");
        std::fs::write(&job, self.lines.join("\n")).expect("write job");
        let status = Command::new(emulator)
            .arg(&job)
            .output()
            .expect("run emulator");
        assert!(
            status.status.success(),
            "emulator failed: {}",
            String::from_utf8_lossy(&status.stderr)
        );
        let tensors = outputs
            .iter()
            .enumerate()
            .map(|(i, (_, dtype, dims))| {
                let bytes = std::fs::read(self.dir.join(format!("out{i}.bin"))).expect("output");
                decode(&bytes, *dtype, dims)
            })
            .collect();
        let _ = std::fs::remove_dir_all(&self.dir);
        tensors
    }
}

/// The first `dims`-many elements of `bytes` as a CPU tensor of `dtype`.
fn decode(bytes: &[u8], dtype: DType, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let t = match dtype {
        DType::F32 => {
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            Tensor::from_vec(v[..n].to_vec(), dims, &Device::Cpu)
        }
        DType::U32 => {
            let v: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            Tensor::from_vec(v[..n].to_vec(), dims, &Device::Cpu)
        }
        DType::F16 => {
            let v: Vec<half::f16> = bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect();
            Tensor::from_vec(v[..n].to_vec(), dims, &Device::Cpu)
        }
        _ => {
            let v: Vec<half::bf16> = bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect();
            Tensor::from_vec(v[..n].to_vec(), dims, &Device::Cpu)
        }
    };
    t.expect("output tensor")
}
