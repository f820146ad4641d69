"""Compile the chunked delta rule's three launches for sm_90 on any machine (no GPU needed) and print what each
kernel takes of an SM: registers per thread, local-memory stack (spilled registers), shared memory, and the
spill loads / stores and wgmma instructions in its SASS.

A launch that spills or needs most of an SM's shared memory runs one program an SM with its products waiting on
local memory: the seventy-second session found the tf32x3 products (each operand split in two) spilling in every
launch that held whole [64, 128] fp32 tiles. Qwen3.5-9B's heads (128 x 128) unless told:

    python tools/delta_rule_resources.py [--dk 128 --dv 128] [--launches prepare scan output]

Triton's version matters (the lent H100 / H200 image has 3.6): the numbers are the compiler's, for the Triton
installed here.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radiance.kernels._triton import gated_delta_chunked as chunked

SM90 = GPUTarget("cuda", 90, 32)
SHARED_PER_SM = 227 * 1024  # what one sm_90 program may take (H100 / H200)

PREPARE = dict(k_ptr="*bf16", v_ptr="*bf16", g_ptr="*fp32", beta_ptr="*bf16", starts_ptr="*i32", lens_ptr="*i32",
               w_ptr="*fp32", u_ptr="*fp32", kd_ptr="*fp32", decay_ptr="*fp32", Dk="i32", Dv="i32",
               stride_kt="i32", stride_kh="i32", stride_vt="i32", stride_vh="i32", stride_gt="i32", stride_bt="i32")
SCAN = dict(w_ptr="*fp32", u_ptr="*fp32", kd_ptr="*fp32", decay_ptr="*fp32", v_new_ptr="*fp32",
            entering_ptr="*fp32", state_ptr="*fp32", slot_ptr="*i32", first_ptr="*i32", continues_ptr="*i32",
            Dk="i32", Dv="i32", stride_ss="i32", stride_sh="i32", stride_sk="i32")
OUTPUT = dict(q_ptr="*bf16", k_ptr="*bf16", g_ptr="*fp32", v_new_ptr="*fp32", entering_ptr="*fp32",
              starts_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", scale="fp32", Dk="i32", Dv="i32",
              stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32", stride_gt="i32")


class Resources(NamedTuple):
    registers: int  # per thread
    stack: int  # bytes of local memory per thread: spilled registers
    shared: int  # bytes per program
    spill_instructions: int  # LDL / STL in the SASS
    wgmma: int  # HGMMA instructions in the SASS

    def row(self) -> str:
        return (f"{self.registers} | {self.stack} | {self.shared // 1024} | {self.spill_instructions} | "
                f"{self.wgmma}")


def _nvidia_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_for_sm90(fn, signature: dict, constants: dict, num_warps: int, num_stages: int = 3) -> Resources:
    """fn compiled for sm_90 with its pointers 16-byte aligned (as the launcher specializes them at run time)."""
    full = dict(signature, **{name: "constexpr" for name in constants})
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    source = ASTSource(fn=fn, signature=full, attrs=aligned,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    kernel = triton.compile(source, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as fh:
            fh.write(kernel.asm["cubin"])
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    return Resources(int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)),
                     kernel.metadata.shared, len(re.findall(r"\b(?:LDL|STL)\b", sass)), sass.count("HGMMA"))


def launches(dk: int, dv: int, heads: tuple[int, int] = (16, 32), precision: str = "tf32x3",
             inverses: tuple[str, ...] = ("blocks", "doubling", "refined")):
    """(name, kernel, signature, constants, num_warps, num_stages) of each launch chunked_prefill makes with its
    defaults at these head dims (the output launch for a bf16 output: single tf32)."""
    defaults = {name: p.default for name, p in inspect.signature(chunked.chunked_prefill).parameters.items()}
    block_k, block_dv = chunked.block_dims(dk, dv)
    hk, hv = heads
    stages = 3  # Triton's default num_stages, which chunked_prefill keeps (scan_stages None)
    common = dict(HV=hv, GROUP=hv // hk, C=chunked.CHUNK, BLOCK_K=block_k, BLOCK_DV=block_dv, PRECISION=precision)
    for inverse in inverses:
        yield (f"prepare ({inverse})", chunked.chunk_prepare_kernel, PREPARE, dict(common, INVERSE=inverse),
               defaults["num_warps"], stages)
    yield ("scan", chunked.chunk_scan_kernel, SCAN, dict(common, BLOCK_V=max(16, min(defaults["block_v"], block_dv))),
           defaults["scan_warps"], stages)
    output = chunked.default_output_precision(precision, torch.bfloat16)
    yield ("output", chunked.chunk_output_kernel, OUTPUT,
           dict(common, BLOCK_V=max(16, min(defaults["output_block_v"], block_dv)), PRECISION=output),
           defaults["output_warps"] or defaults["num_warps"], stages)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--launches", nargs="+", default=["prepare", "scan", "output"],
                        choices=["prepare", "scan", "output"])
    args = parser.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90, Dk {args.dk}, Dv {args.dv}")
    print("| launch | registers | stack bytes | shared KB | LDL/STL | HGMMA |\n|---|---|---|---|---|---|")
    for name, fn, signature, constants, warps, stages in launches(args.dk, args.dv):
        if name.split()[0] in args.launches:
            print(f"| {name} | {compile_for_sm90(fn, signature, constants, warps, stages).row()} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
