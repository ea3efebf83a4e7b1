#!/usr/bin/env python3
"""Compiles the device engine's run-time kernels (kernels/src/cuda: common.cuh, then every
.cu, as one program) the way the engine does on the GPU machine, with NVRTC for compute
capability 8.0 (target-engine/src/device/fused.rs), then assembles the PTX for sm_90 (H100/H200) with ptxas and prints each kernel's
registers, shared memory and spills. Fails on a compile error or a spill. No GPU needed:
scripts/gpu/build.sh runs it with NVRTC and ptxas from PyPI's CUDA 13.0 wheels.

    python3 scripts/gpu/nvrtc_check.py --nvrtc DIR/libnvrtc.so.13 --ptxas DIR/ptxas
"""
import argparse
import ctypes
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
# As target-engine/src/device/fused.rs compiles them.
OPTIONS = [b"--gpu-architecture=compute_80"]


def program():
    """common.cuh and the kernels after it, as fused.rs concatenates them."""
    cuda = ROOT / "kernels/src/cuda"
    files = [cuda / "common.cuh"] + sorted(cuda.glob("*.cu"))
    return b"\n".join(f.read_bytes() for f in files)


def nvrtc_ptx(lib, path, src):
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.name.encode(), 0, None, None)
    if rc != 0:
        sys.exit(f"{path}: nvrtcCreateProgram failed ({rc})")
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    rc = lib.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if rc != 0:
        sys.exit(f"{path}: NVRTC failed to compile it:\n{text}")
    if text:
        print(f"{path.name}: NVRTC says:\n{text}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", required=True, help="libnvrtc.so.13 (its builtins beside it on LD_LIBRARY_PATH)")
    ap.add_argument("--ptxas", required=True, help="ptxas of the same toolkit")
    ap.add_argument("--arch", default="sm_90", help="the GPU to assemble for (default sm_90)")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc)
    failed = False
    for path in [pathlib.Path("kernels.cu")]:
        ptx = nvrtc_ptx(lib, path, program())
        with tempfile.TemporaryDirectory() as tmp:
            ptx_path = pathlib.Path(tmp) / "k.ptx"
            ptx_path.write_bytes(ptx)
            out = subprocess.run(
                [args.ptxas, f"-arch={args.arch}", "-v", str(ptx_path), "-o", str(pathlib.Path(tmp) / "k.cubin")],
                capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{path}: ptxas failed:\n{out.stderr}")
        name = None
        for line in out.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                name = m.group(1)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and (int(m.group(1)) or int(m.group(2))):
                print(f"{path.name} {name}: spills registers: {line.strip()}")
                failed = True
            m = re.search(r"Used (\d+) registers", line)
            if m:
                print(f"{path.name} {name} ({args.arch}): {line.split('info    :')[-1].strip()}")
    if failed:
        sys.exit("a kernel spills registers to local memory")


if __name__ == "__main__":
    main()
