#!/usr/bin/env python3
"""Checks the machine code of the crate's CUDA kernels for memory reads ahead of the
dependent-launch wait.

Every kernel launches with programmatic dependent launch (src/kernels/cuda/kernel_cache.rs): it
may start while the kernel before it still writes, and must wait (`griddepcontrol.wait`,
`ACQBULK` in SASS) before reading what that kernel writes. Source order is not enough: reads
through `const __restrict__` pointers compile to the read-only path (`LDG.*.CONSTANT`), which
the compilers may move above the wait. This script disassembles the fatbins a `cuda` build
wrote and fails when

- a kernel has no wait (except `gpu_spin`, a diagnostic that reads nothing), or
- a kernel reads or writes global memory before its first wait, except the early `qmv_row4`
  forms (names ending in `e`), which may load packed weights there: streamed 16-byte code
  loads (`LDG.E.NA.128.CONSTANT`) and 2-byte scale and bias loads (`LDG.E.U16.CONSTANT`).

Usage: scripts/check_pdl_order.py OUT_DIR (the build's `out` folder holding the `.fatbin`
files, e.g. target/release/build/candle-gemma-*/out). Needs `cuobjdump` and `nvdisasm` on
PATH or in CUDA_ROOT/bin.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

NO_WAIT_OK = {"gpu_spin"}
EARLY = re.compile(r"^qmv_row4_(norm_)?(f16|bf16)_u\d+l?e$")
EARLY_LOADS = {"LDG.E.NA.128.CONSTANT", "LDG.E.U16.CONSTANT"}
MEMORY = re.compile(r"(LDG|STG|ATOMG?|RED|LD|ST|LDGSTS)(\.|$)")


def tool(name):
    root = os.environ.get("CUDA_ROOT")
    path = shutil.which(name) or (root and os.path.join(root, "bin", name))
    if not path or not os.path.exists(path):
        sys.exit(f"{name} not found (PATH or CUDA_ROOT/bin)")
    return path


def kernels(sass):
    """(name, instructions) for every function of an nvdisasm listing."""
    for part in re.split(r"\n(?=\s*\.text\.)", sass):
        m = re.match(r"\s*\.text\.(\w+)", part)
        if m:
            ops = [
                line.split("*/", 1)[1].strip().rstrip(";").strip()
                for line in part.split("\n")
                if re.search(r"/\*[0-9a-f]{4}\*/", line)
            ]
            yield m.group(1), ops


def check(name, ops):
    waits = [i for i, op in enumerate(ops) if op.startswith("ACQBULK")]
    if not waits:
        return [] if name in NO_WAIT_OK else ["no dependent-launch wait"]
    mnemonics = [re.sub(r"^@!?U?P\w+\s+", "", op).split(" ")[0] for op in ops[: waits[0]]]
    early = [m for m in mnemonics if MEMORY.match(m)]
    if EARLY.match(name):
        early = [op for op in early if op not in EARLY_LOADS]
    return [f"{op} before the wait" for op in early]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    fatbins = sorted(glob.glob(os.path.join(sys.argv[1], "*.fatbin")))
    if not fatbins:
        sys.exit(f"no .fatbin in {sys.argv[1]}")
    cuobjdump, nvdisasm = tool("cuobjdump"), tool("nvdisasm")
    bad, seen = 0, 0
    for fatbin in fatbins:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([cuobjdump, "-xelf", "all", fatbin], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL)
            for cubin in glob.glob(os.path.join(tmp, "*.cubin")):
                sass = subprocess.run([nvdisasm, "-c", cubin], check=True,
                                      capture_output=True, text=True).stdout
                for name, ops in kernels(sass):
                    seen += 1
                    for problem in check(name, ops):
                        bad += 1
                        print(f"{os.path.basename(fatbin)} {name}: {problem}")
    print(f"{seen} kernels, {bad} problems")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
