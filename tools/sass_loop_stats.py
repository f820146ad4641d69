"""Compile the W4A8 GEMM for sm_90 on a machine without a GPU and count the SASS of its main loop.

The per-weight instruction count of the K loop decides whether the e2m1 -> e4m3 expansion can keep
up with HBM (the SM issues 128 thread-instructions per clock). Usable with any Triton that matches
the device's (`pip install triton==3.6.0` into a scratch venv; it needs no torch):

    python tools/sass_loop_stats.py [--out DIR]

For each configuration it prints the loop length, thread-instructions per weight and the opcode mix,
and writes the TTGIR, PTX and SASS under DIR for reading.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_kernels():
    """Import radiance/kernels/_triton/*.py without importing radiance (and torch)."""
    for name in ("radiance", "radiance.kernels", "radiance.kernels._triton"):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(ROOT, *name.split("."))]
        sys.modules.setdefault(name, mod)
    mods = {}
    for name in ("act_quant", "convert", "gemm"):
        full = f"radiance.kernels._triton.{name}"
        path = os.path.join(ROOT, "radiance/kernels/_triton", f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, path)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[full] = mods[name]
        spec.loader.exec_module(mods[name])
    return mods


GEMM_SIG = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*i32", shift_ptr="*i32", ws_ptr="*fp32", bias_ptr="*fp32",
                out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32", amax_ptr="*i32", M="i32", N="i32", K="i32",
                stride_xm="i32", stride_om="i32", k_tiles_per_split="i32", splits="i32")
# what Triton's launcher specializes at run time for our usual shapes: 16-aligned pointers and dims
DIVISIBLE = [a for a, t in GEMM_SIG.items() if t.startswith("*")] + ["N", "K", "stride_xm", "stride_om"]

CONFIGS = (  # (label, BM, BN, BK, SWAP_AB, splits, warps, stages, precise); "glu": SiLU-mul epilogue
    ("decode", 16, 64, 256, True, 5, 4, 4, True),
    ("decode-glu", 16, 64, 256, True, 1, 4, 4, True),
    ("decode-glu", 64, 128, 256, True, 1, 4, 3, True),
    ("decode", 16, 64, 256, True, 5, 4, 4, False),
    ("decode", 64, 64, 256, True, 2, 4, 4, True),
    # below 4 warps Triton has no wgmma and lowers the fp8 dot to f16 mma.sync, converting every e4m3 byte
    # (thirty-fifth session): kept to show it
    ("decode", 16, 32, 256, True, 5, 2, 4, True),
    ("decode", 16, 16, 256, True, 5, 1, 4, True),
    ("prefill-swap", 128, 128, 128, True, 1, 8, 3, True),
    ("prefill-swap", 256, 128, 128, True, 1, 8, 3, True),
    ("prefill-swap", 256, 128, 128, True, 1, 4, 3, True),
    ("prefill-swap", 128, 256, 128, True, 1, 8, 3, True),
    ("prefill", 128, 128, 128, False, 1, 8, 3, True),
    ("prefill", 128, 256, 128, False, 1, 8, 3, True),
)


def compile_sass(fn, consts: dict, num_warps: int, num_stages: int, name: str, out_dir: str):
    sig = dict(GEMM_SIG, **{k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    os.makedirs(out_dir, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
            f.write(kernel.asm[ext])
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out_dir, f"{name}.sass"), "w") as f:
        f.write(sass)
    return kernel, sass


def longest_loop(sass: str) -> list[str]:
    """Instructions of the largest backward-branch loop body."""
    instrs, label_at, pending = [], {}, []
    for line in sass.splitlines():
        lab = re.match(r"\s*\.L_x_(\d+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                label_at[p] = addr
            pending = []
            instrs.append((addr, m.group(2)))
    best: list[str] = []
    for addr, ins in instrs:
        m = re.search(r"BRA.*\.L_x_(\d+)", ins)
        if m and label_at.get(m.group(1), addr + 1) < addr:
            body = [i for a, i in instrs if label_at[m.group(1)] <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def registers(cubin: str) -> int:
    """Registers per thread of the compiled kernel (cuobjdump -res-usage, shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def opcode_mix(body: list[str]) -> collections.Counter:
    mix = collections.Counter()
    for ins in body:
        words = ins.split()
        op = words[1] if words[0].startswith("@") else words[0]
        mix[op.split(".")[0]] += 1
    return mix


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/radiance-sass", help="where TTGIR, PTX and SASS are written")
    args = p.parse_args(argv)
    gemm = _load_kernels()["gemm"]
    for label, bm, bn, bk, swap, split, warps, stages, precise in CONFIGS:
        consts = dict(HAS_BIAS=False, SWAP_AB=swap, SPLIT=split > 1, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=True,
                      USE_ASM=True, PRECISE_ACC=precise, DEPENDENT=False, PDL_PREFETCH=0,
                      GLU=label.endswith("glu"), DEFER_SUM=False, ACT=0)
        name = f"{label}_{bm}x{bn}x{bk}_w{warps}s{stages}{'_precise' if precise else ''}"
        kernel, sass = compile_sass(gemm.w4a8_gemm_kernel, consts, warps, stages, name, args.out)
        body = longest_loop(sass)
        per_weight = len(body) * 32 * warps / (bn * bk)
        mix = ", ".join(f"{op} {n}" for op, n in opcode_mix(body).most_common(12))
        spills = sum(1 for line in sass.splitlines() if re.search(r"\b(LDL|STL)\b", line))
        mma = sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S+", kernel.asm["ptx"])))
        regs = registers(os.path.join(args.out, name + ".cubin"))
        print(f"{name:44s} smem {kernel.metadata.shared:6d} B  regs {regs:3d}  loop {len(body):4d}  "
              f"{per_weight:.2f} instr/weight  local-memory instrs {spills}")
        print(f"    MMA: {', '.join(mma)}")
        print(f"    {mix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
