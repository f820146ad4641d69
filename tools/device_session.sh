#!/usr/bin/env bash
# Device calls that re-check and re-measure everything GPU-side, writing logs under $OUT and printing the
# tables last. Run from the repo root on the device (after `../shared/tools/device-wheels.sh` with the packages
# the README's developer section lists filled .whl/ here; carry ".whl"):  bash tools/device_session.sh MODE   (each mode fits one 10-minute call)
#   quick    the kernel and format GPU tests, the 8B engine in bf16 and MXFP4 (about 9 minutes on a cold machine:
#            the tests compile for about 5)
#   gpu-engine  the attention and engine GPU tests (test_attention*_triton.py, test_gpu_engine.py: on a cold H200
#            the whole engine + LoRA set ran past 560 s at 74 of 93 tests in the seventieth session; up to 10)
#   gpu-more    the rest of the engine and LoRA GPU tests (MoE, min_tokens, speculative, structured output, LoRA)
#   cases    the Triton kernel cases on the GPU (about 4)
#   kernels  the full kernel table (ours, cuBLAS bf16, cuBLAS fp8) and the per-CTA GEMM trace (about 5)
#   models   the 32B engine in bf16 and MXFP4, the batch-64 step timeline of the 8B, its GEMMs traced
#            inside batch-1 decode steps, and its decode steps with small kernels stubbed out (about 6)
#   sweep    the tile sweep over the 8B shapes (every candidate gated on numerics first); prints
#            tuning-table entries for tuning/sm90.json (up to 10)
#   splits   the decode GEMMs' split counts tuned inside the batch-1 decode step, 8B then 32B; prints
#            tuning-table entries (about 3)
#   retune   the same at batches 1, 8 and 64 (8B) and 1, 8 (32B): after anything that changes how decode
#            GEMMs share the SMs (the occupancy cap moved five shapes' entries); prints entries (about 5)
#   pdl      which norm releases its GEMM early (tools/early_release_ab.py) and how deep the down GEMM, resident
#            during gate_up since the early-released quantize, prefetches (pdl_prefetch_sweep.py --shape), 8B and
#            32B at batches 1 and 8 (about 5)
#   hybrid   KV groups off / on (tools/kv_groups_ab.py, Gemma 3 12B: blocks, 32k sequences that fit, decode ms),
#            then Llama 4 Scout in MXFP4 on the engine (~57 GB of weights: fits one H100; never run yet)
#   glm      GLM-4.5's GPU checks: grouped experts vs the loop, graphs; the routing and rotary kernel cases
#            compiled (about 7)
#   glm-engine  GLM-4.5-Air in MXFP4 on the engine (~57 GB of weights: fits one H100; never run yet; up to 9)
#   hybrid-qwen  Qwen3.5 / Qwen3-Next: the Gated DeltaNet kernels compiled against their torch reference, the
#            engine on CUDA (decode graphs carrying state slots, piecewise graphs) against the CPU's greedy tokens and
#            eager MXFP4, then Qwen3.5-9B's decode / prefill in bf16 and MXFP4 (up to 9)
#   hybrid-steps  the chunked delta rule's cases compiled, then Qwen3.5-9B's delta-rule kernels timed
#            (tools/gated_delta_prefill_sweep.py: the served chunked form against its output launch in tf32x3 and the
#            "doubling" and "refined" inverses, never compiled on a GPU since their fix, and the scan at 1 and 2
#            pipeline stages), then the first four forms' MXFP4 prefill tok/s on the engine
#            (tools/delta_rule_engine_ab.py; up to 9)
set -u
OUT=${OUT:-/tmp/radiance-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
step() {  # step SECONDS NAME COMMAND...: run with a time limit, keep the log, print its tail
    local limit=$1 name=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name (exit $?)"; tail -n 4 "$OUT/$name.log"
}
case "${1:-quick}" in
quick)
    step 380 gpu-tests python3 -m pytest -q -m gpu tests/kernels tests/formats
    step 200 engine-8b python3 -m radiance.bench.engine_bench synthetic:llama-3.1-8b --quantization none mxfp4 \
        --contexts 128 8192 --prefills 1024 8192 --concurrency 1 64 128 --no-hf --json "$OUT/engine-8b.json"
    ;;
gpu-engine)
    step 570 gpu-engine-tests python3 -m pytest -q -m gpu tests/engine/test_attention_sinks_triton.py \
        tests/engine/test_attention_triton.py tests/engine/test_gpu_engine.py
    ;;
gpu-more)
    step 570 gpu-more-tests python3 -m pytest -q -m gpu tests/engine tests/lora \
        --deselect tests/engine/test_attention_sinks_triton.py --deselect tests/engine/test_attention_triton.py \
        --deselect tests/engine/test_gpu_engine.py
    ;;
cases)
    step 500 kernel-cases python3 -m pytest -q tests/kernels/triton_cases_*.py
    ;;
kernels)
    step 240 kernel-table python3 -m radiance.bench.kernels --m 1 4 16 64 128 256 1024 4096 8192 --no-reference \
        --out "$OUT/kernel-table.txt"
    step 120 cta-trace python3 tools/gemm_cta_trace.py --m 1 64
    ;;
models)
    step 200 engine-32b python3 -m radiance.bench.engine_bench synthetic:qwen3-32b --quantization none mxfp4 \
        --contexts 128 --prefills 8192 --concurrency 64 --no-hf --json "$OUT/engine-32b.json"
    step 100 timeline-64 python3 tools/decode_timeline.py --quantization mxfp4 --batch 64
    step 120 engine-trace python3 tools/gemm_cta_trace.py --engine synthetic:llama-3.1-8b
    step 150 ablation python3 tools/decode_ablation.py
    ;;
sweep)
    step 560 sweep python3 -m radiance.bench.kernels --sweep --no-table --m 1 16 64 256 \
        --shapes 6144x4096 4096x4096 28672x4096 4096x14336 --out "$OUT/sweep.txt"
    grep -h "^best" "$OUT/sweep.log"
    ;;
splits)
    step 240 splits-8b python3 tools/decode_split_sweep.py --model synthetic:llama-3.1-8b
    step 300 splits-32b python3 tools/decode_split_sweep.py --model synthetic:qwen3-32b
    grep -h '^{"shape"' "$OUT"/splits-*.log
    ;;
retune)
    for b in 1 8 64; do step 120 "retune-8b-b$b" python3 tools/decode_split_sweep.py --batch "$b" --splits 1 2 3 4 6 8; done
    for b in 1 8; do step 120 "retune-32b-b$b" python3 tools/decode_split_sweep.py --model synthetic:qwen3-32b \
        --batch "$b" --splits 1 2 3 4 6 8; done
    grep -h -B1 '^{"shape"\|winners' "$OUT"/retune-*.log
    ;;
pdl)
    step 100 early-8b python3 tools/early_release_ab.py --batches 1 8
    step 100 early-32b python3 tools/early_release_ab.py --model synthetic:qwen3-32b --batches 1 8 --repeats 2
    step 80 prefetch-down-8b python3 tools/pdl_prefetch_sweep.py --shape 4096x14336 --tiles 1 2 4 --batches 1 8
    step 90 prefetch-down-32b python3 tools/pdl_prefetch_sweep.py --model synthetic:qwen3-32b --shape 5120x25600 \
        --tiles 1 2 4 --batches 1 8 --repeats 2
    grep -h "batch 1" "$OUT"/early-*.log "$OUT"/prefetch-*.log
    ;;
hybrid)
    step 220 kv-groups python3 tools/kv_groups_ab.py synthetic:gemma-3-12b 128 32000
    step 340 engine-scout python3 -m radiance.bench.engine_bench synthetic:llama-4-scout-17b-16e --quantization mxfp4 \
        --contexts 128 16000 --prefills 1024 8192 --concurrency 1 16 64 --no-hf --json "$OUT/engine-scout.json"
    tail -n 3 "$OUT/kv-groups.log"
    ;;
glm)
    step 240 glm-tests python3 -m pytest -q -m gpu tests/engine/test_gpu_moe.py -k glm4moe
    step 200 glm-cases python3 -m pytest -q tests/kernels/triton_cases_rotary.py tests/kernels/triton_cases_moe_route.py \
        tests/kernels/triton_cases_moe_block.py
    ;;
glm-engine)
    step 500 engine-glm python3 -m radiance.bench.engine_bench synthetic:glm-4.5-air --quantization mxfp4 \
        --contexts 128 8192 --prefills 1024 8192 --concurrency 1 16 64 --no-hf --json "$OUT/engine-glm.json"
    ;;
hybrid-qwen)
    step 150 gd-cases python3 -m pytest -q -x tests/kernels/triton_cases_gated_delta.py \
        tests/kernels/triton_cases_gated_delta_prefill.py
    step 150 gd-engine python3 -m pytest -q -m gpu tests/engine/test_gpu_engine.py -k "qwen3_5 or hybrid"
    step 240 engine-qwen35 python3 -m radiance.bench.engine_bench synthetic:qwen3.5-9b --quantization none mxfp4 \
        --contexts 128 8192 --prefills 1024 8192 --concurrency 1 16 --no-hf --json "$OUT/engine-qwen35.json"
    ;;
hybrid-steps)
    step 90 gd-prefill-cases python3 -m pytest -q tests/kernels/triton_cases_gated_delta_prefill.py
    step 200 gd-sweep python3 tools/gated_delta_prefill_sweep.py --tilings 8x1 --lengths 1024 8192 \
        --chunked 32:64/tf32x3/4:8/blocks 32:64/tf32x3:tf32x3/4:8/blocks 32:64/tf32x3/4:8/doubling \
        32:64/tf32x3/4:8/refined 32:64/tf32x3/4:8/blocks/1 32:64/tf32x3/4:8/blocks/2
    step 250 delta-engine python3 tools/delta_rule_engine_ab.py --forms served 32:64/tf32x3:tf32x3/4:8/blocks \
        32:64/tf32x3/4:8/doubling 32:64/tf32x3/4:8/refined
    grep -h "^| " "$OUT/delta-engine.log"
    ;;
*)
    echo "usage: bash tools/device_session.sh [quick|gpu-engine|gpu-more|cases|kernels|models|sweep|splits|retune|pdl|hybrid|glm|glm-engine|hybrid-qwen|hybrid-steps]" >&2
    exit 2
    ;;
esac
grep -h -A3 "^variant" "$OUT"/engine-*.log 2>/dev/null
grep -h "^| [0-9]" "$OUT/kernel-table.log" 2>/dev/null
grep -h "^==\|SMs holding" "$OUT/cta-trace.log" 2>/dev/null
cat "$OUT/engine-trace.log" 2>/dev/null | grep -v "^INFO" | tail -n 8
grep -h -A8 "^removed |" "$OUT/ablation.log" 2>/dev/null
grep -h "^| [0-9]* | \|ms by launch" "$OUT/gd-sweep.log" 2>/dev/null
