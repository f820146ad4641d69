"""tools/grid_barrier_bench.py: its CPU dry run (the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when
Triton is imported) checks that the chain of launches and the persistent kernel both sum what torch sums."""

from tests.bench.tool_run import run_tool


def test_dry_run_sums_as_torch_does():
    proc = run_tool("grid_barrier_bench.py", "--mb", "0", "0.05", "--phases", "5", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("both kernels sum as torch does") == 2, proc.stdout


def test_dry_run_needs_the_interpreter():
    proc = run_tool("grid_barrier_bench.py", "--dry-run", interpret=False)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
