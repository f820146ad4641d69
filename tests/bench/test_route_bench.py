"""tools/route_bench.py: its CPU dry run (the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when Triton
is imported) checks that every setting of the routing switches routes alike."""

from tests.bench.tool_run import run_tool


def test_dry_run_finds_every_variant_alike():
    proc = run_tool("route_bench.py", "--tokens", "1", "3", "8", "--models", "128x8", "32x4", "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("every variant routes alike") == 6, proc.stdout


def test_dry_run_needs_the_interpreter():
    proc = run_tool("route_bench.py", "--dry-run", interpret=False)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr
