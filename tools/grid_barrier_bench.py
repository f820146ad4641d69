"""What a kernel boundary costs against a grid-wide barrier inside one persistent kernel, on the GPU: the number that
decides whether a persistent decode "megakernel" (a layer's phases separated by barriers, not launches) can beat the
chain of launches the batch-1 decode step is today (bench/RESULTS.md: ~2.5-2.8 us per small kernel whatever its work).

Each phase streams `--mb` MB of a buffer far larger than the L2 (a stand-in for a decode GEMM's weight; 0: no work),
spread over `--programs` programs. "chain": one launch per phase, programmatic dependents as the engine launches them
(each waits for the one before, then releases the next), all captured in one CUDA graph, and the same without PDL;
"persistent": one launch that runs every phase, its programs (all resident: at most four per SM) meeting at an
atomic-counter barrier between phases. Prints us per phase for each and the HBM-bound time of the bytes.

    python3 tools/grid_barrier_bench.py [--mb 0 2 9 13 31] [--phases 64] [--programs 132]

--dry-run (CPU, Triton interpreter, one program: the barrier opens at once) checks the sums both kernels compute
against torch instead of timing (tests/bench/test_grid_barrier_bench.py).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from radiance import env
from radiance.kernels._triton.act_quant import arrive_and_wait, pdl_handoff
from radiance.kernels.device_info import sm_count, supports_pdl
from radiance.kernels.timing import L2_BYTES, time_us

BLOCK = 2048  # int32 words a program loads per step
HBM_TB_S = 4.17  # the H200's measured copy rate (shared/DESIGN.md)


@triton.jit
def _stream(buf, out, phase, region, words_per_program, regions, BLOCK: tl.constexpr):
    """Program p's share of phase `phase`: the sum of its words of region `phase % regions`, stored to out[phase, p]
    (the sum keeps every load live)."""
    p = tl.program_id(0)
    base = buf + (phase % regions).to(tl.int64) * region + p.to(tl.int64) * words_per_program
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, words_per_program, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < words_per_program, other=0)
    tl.store(out + phase * tl.num_programs(0) + p, tl.sum(acc, axis=0))


# Triton specializes an int argument equal to 1 into a constant, which has no .to(): keep the counts runtime values.
@triton.jit(do_not_specialize=["phase", "region", "words_per_program", "regions"])
def _phase_kernel(buf, out, phase, region, words_per_program, regions, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_handoff(PDL)
    _stream(buf, out, phase, region, words_per_program, regions, BLOCK)


@triton.jit(do_not_specialize=["phases", "region", "words_per_program", "regions"])
def _persistent_kernel(buf, out, count, phases, region, words_per_program, regions, BLOCK: tl.constexpr):
    programs = tl.num_programs(0)
    for phase in range(phases):
        _stream(buf, out, phase, region, words_per_program, regions, BLOCK)
        # grid barrier; the CTA barrier first, as a real phase needs (every thread's stores before the release)
        tl.debug_barrier()
        arrive_and_wait(count, programs)


class Workload:
    """The buffer (regions of `mb` MB, enough of them to exceed the L2 several times), outputs and barrier count."""

    def __init__(self, mb: float, programs: int, phases: int, device: str):
        words = max(1, int(mb * 2**20 / 4) // programs) if mb else 0
        self.words_per_program, self.programs, self.phases = words, programs, phases
        self.region = words * programs
        self.regions = max(1, min(phases, -(-4 * L2_BYTES // max(1, 4 * self.region)))) if words else 1
        gen = torch.Generator().manual_seed(0)
        self.buf = torch.randint(0, 4, (max(1, self.region * self.regions),), generator=gen,
                                 dtype=torch.int32).to(device)
        self.out = torch.zeros(phases, programs, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.pdl = supports_pdl(self.buf.device)

    def phase_launch(self, phase: int, pdl: bool = True) -> None:
        pdl = pdl and self.pdl
        _phase_kernel[(self.programs,)](self.buf, self.out, phase, self.region, self.words_per_program, self.regions,
                                        BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl, num_warps=4)

    def persistent_launch(self) -> None:
        _persistent_kernel[(self.programs,)](self.buf, self.out, self.count, self.phases, self.region,
                                             self.words_per_program, self.regions, BLOCK=BLOCK, num_warps=4)

    def expected(self) -> torch.Tensor:
        """out as both kernels should leave it (torch)."""
        regions = self.buf[:self.region * self.regions].view(self.regions, self.programs, -1).sum(-1, dtype=torch.int64)
        return regions[torch.arange(self.phases) % self.regions].to(torch.int32) if self.words_per_program else \
            torch.zeros_like(self.out)


def check(mb: float, phases: int, programs: int = 1) -> None:
    """Raises AssertionError unless both kernels store the sums torch computes (CPU: the interpreter)."""
    work = Workload(mb, programs, phases, "cpu")
    for name, run in (("chain", lambda: [work.phase_launch(k) for k in range(phases)]),
                      ("chain without PDL", lambda: [work.phase_launch(k, pdl=False) for k in range(phases)]),
                      ("persistent", work.persistent_launch)):
        work.out.fill_(-1)
        run()
        assert torch.equal(work.out.cpu(), work.expected().cpu()), f"{name}: sums differ from torch's at {mb} MB"


def measure(mb: float, phases: int, programs: int) -> tuple[float, float, float]:
    """(chain, chain without PDL, persistent) us per phase."""
    work = Workload(mb, programs, phases, "cuda")
    chain = time_us([lambda k=k: work.phase_launch(k) for k in range(phases)])
    plain = time_us([lambda k=k: work.phase_launch(k, pdl=False) for k in range(phases)])
    persistent = time_us([work.persistent_launch]) / phases
    assert torch.equal(work.out, work.expected().to(work.out.device)), f"wrong sums at {mb} MB"
    return chain, plain, persistent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[0, 2, 9, 13, 31], help="MB streamed per phase")
    p.add_argument("--phases", type=int, default=64)
    p.add_argument("--programs", type=int, default=0,
                   help="programs per launch (0: one per SM; at most four per SM, which all fit at once)")
    p.add_argument("--dry-run", action="store_true", help="check on the CPU (Triton interpreter) instead of timing")
    args = p.parse_args(argv)
    if args.dry_run:
        if not env.triton_interpret():
            raise SystemExit("--dry-run runs the Triton kernels on the CPU: set TRITON_INTERPRET=1")
        for mb in args.mb:
            check(mb, args.phases)
            print(f"{mb} MB per phase: both kernels sum as torch does")
        return
    if not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    sms = sm_count(torch.device("cuda"))
    programs = args.programs or sms
    if programs > 4 * sms:  # 4 warps and no shared memory: four programs per SM are resident together
        raise SystemExit(f"the persistent kernel's barrier needs every program resident: at most {4 * sms} programs")
    print(f"{programs} programs, {args.phases} phases; us per phase")
    print(f"| MB per phase | chain (PDL) | chain without PDL | persistent | HBM-bound ({HBM_TB_S} TB/s) |")
    print("|---|---|---|---|---|")
    for mb in args.mb:
        chain, plain, persistent = measure(mb, args.phases, programs)
        print(f"| {mb:g} | {chain:.2f} | {plain:.2f} | {persistent:.2f} | {mb * 2**20 / (HBM_TB_S * 1e6):.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
