#!/usr/bin/env bash
# The hybrid models' (Qwen3.5 / Qwen3-Next) first GPU checks, in one device call: the Gated DeltaNet decode kernels
# compiled against their torch reference, the engine on CUDA (decode graphs carrying state slots) against the CPU's
# greedy tokens, then the 9B's decode and prefill timings in bf16 and MXFP4. Run from the repo root on the device
# with PYTHONPATH set as tools/device_session.sh sets it; logs under $OUT.
set -u
OUT=${OUT:-/tmp/radiance-out}
mkdir -p "$OUT"
step() {  # step SECONDS NAME COMMAND...
    local limit=$1 name=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (exit $?)"; tail -n 4 "$OUT/$name.log"
}
step 150 gd-cases python3 -m pytest -q -x tests/kernels/triton_cases_gated_delta.py
step 150 gd-engine python3 -m pytest -q -m gpu tests/engine/test_gpu_engine.py -k qwen3_5
step 240 engine-qwen35 python3 -m radiance.bench.engine_bench synthetic:qwen3.5-9b --quantization none mxfp4 \
    --contexts 128 8192 --prefills 1024 --concurrency 1 16 --no-hf --json "$OUT/engine-qwen35.json"
grep -h -A3 "^variant" "$OUT"/engine-*.log 2>/dev/null
