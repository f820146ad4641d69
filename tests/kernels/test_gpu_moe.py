"""GPU checks of the grouped W4A8 GEMM (H200 / sm_90): Qwen3-MoE-sized experts in bf16 against the exact
reference, the dense kernel's bytes per expert, fp8 wgmma in the PTX, and routing + GEMMs captured in a
CUDA graph without a host sync. Run with `python -m pytest -m gpu tests/kernels`."""

import pytest
import torch

from radiance.kernels.activation import quantize_activations
from radiance.kernels.moe import (MOE_CONFIGS, MoeGemmConfig, expert_weight, moe_gemm_ptx, stack_experts,
                                  w4a8_moe_gemm, w4a8_moe_reference)
from radiance.kernels.moe_routing import route_to_experts
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.reference import relative_error
from radiance.kernels.tuning import GemmConfig
from radiance.kernels.w4a8 import w4a8_gemm, w4a8_glu
from tests.kernels.conftest import random_mxfp4
from tests.kernels.triton_cases_moe import random_topk_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PLAIN64 = MoeGemmConfig(block_m=64, block_n=64, block_k=128, swap_ab=False, num_warps=4, num_stages=3)
SWAP64 = MoeGemmConfig(block_m=64, block_n=64, block_k=256, swap_ab=True, num_warps=4, num_stages=3)
CONFIGS = {"swap16": MOE_CONFIGS[16], "plain64": PLAIN64, "persistent64": MOE_CONFIGS[64], "swap64": SWAP64,
           "swap128": MOE_CONFIGS[128]}
EXPERTS = 16  # Qwen3-30B-A3B has 128 of these shapes; 16 keep the test's preparation short


def _dense_config(cfg: MoeGemmConfig) -> GemmConfig:
    """The dense kernel's tiling that sums each output like the grouped one (no split)."""
    return GemmConfig(block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, swap_ab=cfg.swap_ab,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, split_k=1, precise_acc=cfg.precise_acc)


@pytest.fixture(scope="module")
def qwen3_experts():
    """(gate_up [E, 1536, 2048], down [E, 2048, 768]) at Qwen3-30B-A3B's expert shapes."""
    gate_up = stack_experts([prepare_mxfp4(*random_mxfp4(1536, 2048, "cuda")) for _ in range(EXPERTS)])
    down = stack_experts([prepare_mxfp4(*random_mxfp4(2048, 768, "cuda")) for _ in range(EXPERTS)])
    return gate_up, down


@pytest.mark.parametrize("tiling", list(CONFIGS))
@pytest.mark.parametrize("tokens", (1, 8, 64, 300))
def test_qwen3_shapes_bf16_against_reference(qwen3_experts, tokens, tiling):
    gate_up, down = qwen3_experts
    cfg = CONFIGS[tiling]
    top_k = 8
    ids = random_topk_ids("cuda", tokens, top_k, EXPERTS)
    routing = route_to_experts(ids, EXPERTS, cfg.block_m)
    for experts, source in ((gate_up, "token"), (down, "pair")):
        _, n, k = experts.shape
        rows = tokens if source == "token" else tokens * top_k
        x_q, x_scale = quantize_activations(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3)
        out = torch.full((tokens * top_k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source=source, config=cfg, out=out)
        ref = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source=source, out_dtype=torch.float32)
        err = relative_error(out, ref)
        assert err <= 2e-3, f"T={tokens} {tiling} N={n} K={k}: rel {err:.2e}"


@pytest.mark.parametrize("tiling", list(CONFIGS))
@pytest.mark.parametrize("tokens", (3, 70))
def test_bytes_of_the_dense_kernel_per_expert(qwen3_experts, tokens, tiling):
    """Each expert's rows through w4a8_gemm / w4a8_glu with the same tiling: identical bytes, plain and GLU."""
    gate_up, _ = qwen3_experts
    cfg = CONFIGS[tiling]
    ids = random_topk_ids("cuda", tokens, 4, EXPERTS, "same")
    routing = route_to_experts(ids, EXPERTS, cfg.block_m)
    x_q, x_scale = quantize_activations(torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16) * 3)
    out = w4a8_moe_gemm(x_q, x_scale, gate_up, routing, rows_per_pair_source="token", config=cfg)
    y_q, y_s = w4a8_moe_gemm(x_q, x_scale, gate_up, routing, rows_per_pair_source="token", glu=True, config=cfg)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        rows = pairs // 4
        weight = expert_weight(gate_up, e)
        assert torch.equal(out[pairs], w4a8_gemm(x_q[rows], x_scale[rows], weight, config=_dense_config(cfg)))
        want_q, want_s = w4a8_glu(x_q[rows], x_scale[rows], weight, config=_dense_config(cfg))
        assert torch.equal(y_s[pairs], want_s)
        assert torch.equal(y_q[pairs].view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("tiling", list(CONFIGS))
def test_ptx_has_fp8_wgmma(qwen3_experts, tiling):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is sm_90 only")
    gate_up, _ = qwen3_experts
    cfg = CONFIGS[tiling]
    ids = random_topk_ids("cuda", 8, 8, EXPERTS)
    x_q, x_scale = quantize_activations(torch.randn(8, 2048, device="cuda"))
    ptx = moe_gemm_ptx(x_q, x_scale, gate_up, route_to_experts(ids, EXPERTS, cfg.block_m), "token", cfg)
    assert any("wgmma" in line and "e4m3" in line for line in ptx.splitlines()), f"{tiling}: no fp8 wgmma"
    assert "prmt" in ptx


def _moe_mlp(x_q, x_scale, ids, gate_up, down, block_m):
    """Routing, the gate_up GEMM with SiLU-mul, the down GEMM: a Qwen3-MoE MLP before the weighted sum."""
    routing = route_to_experts(ids, EXPERTS, block_m)
    h_q, h_s = w4a8_moe_gemm(x_q, x_scale, gate_up, routing, rows_per_pair_source="token", glu=True)
    return w4a8_moe_gemm(h_q, h_s, down, routing, rows_per_pair_source="pair")


@pytest.mark.parametrize("tokens,block_m", [(2, 16), (100, 64)])
def test_routing_and_gemms_in_a_cuda_graph_without_host_sync(qwen3_experts, tokens, block_m):
    gate_up, down = qwen3_experts
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    ids = random_topk_ids("cuda", tokens, 8, EXPERTS)
    static_x, static_ids = quantize_activations(x), ids.clone()
    _moe_mlp(*static_x, static_ids, gate_up, down, block_m)  # compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in routing or launch raises (capture would fail too)
    try:
        eager = _moe_mlp(*static_x, static_ids, gate_up, down, block_m)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _moe_mlp(*static_x, static_ids, gate_up, down, block_m)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    fresh_x = quantize_activations(torch.randn_like(x))
    fresh_ids = random_topk_ids("cuda", tokens, 8, EXPERTS, "skip")
    static_x[0].copy_(fresh_x[0])
    static_x[1].copy_(fresh_x[1])
    static_ids.copy_(fresh_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _moe_mlp(*fresh_x, fresh_ids, gate_up, down, block_m))
