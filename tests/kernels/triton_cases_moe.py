"""The grouped (mixture-of-experts) W4A8 GEMM vs its exact reference: both tilings, both activation-row
sources, GLU, ragged N and K, experts without pairs, every token on one expert. Run on CUDA, or on the CPU
through the Triton interpreter by test_triton_interpreter.py (fp32 outputs there: see triton_cases_gemm's
GATE note on bf16 under the interpreter)."""

import pytest
import torch

from radiance.kernels.activation import quantize_activations
from radiance.kernels.moe import (MoeGemmConfig, expert_weight, moe_block_m, stack_experts, w4a8_moe_gemm,
                                  w4a8_moe_reference)
from radiance.kernels.moe_routing import route_to_experts
from radiance.kernels.prepare import prepare_mxfp4
from radiance.kernels.reference import relative_error
from radiance.kernels.tuning import GemmConfig
from radiance.kernels.w4a8 import w4a8_glu
from tests.kernels.conftest import random_mxfp4
from tests.kernels.triton_cases_gemm import assert_same_quantized_rows

GATE = 2e-3
# block_k 128 so that the small K here still takes several K tiles; the default tilings (moe.MOE_CONFIGS)
# run where a case passes None
SWAP16 = MoeGemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=True, num_stages=3)
PLAIN64 = MoeGemmConfig(block_m=64, block_n=64, block_k=128, swap_ab=False, num_stages=3)
# persistent: a few programs walk every tile (4 "SMs" under the interpreter), the pipeline crossing tiles
PERSIST16 = MoeGemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=True, num_stages=3, persistent=True)
PERSIST64 = MoeGemmConfig(block_m=64, block_n=64, block_k=128, swap_ab=False, num_stages=3, persistent=True,
                          programs_per_sm=2)
TILINGS = {"swap16": SWAP16, "plain64": PLAIN64, "persist16": PERSIST16, "persist64": PERSIST64,
           "default16": None, "default64": None, "default128": None}
BLOCK_M = {"swap16": 16, "plain64": 64, "persist16": 16, "persist64": 64, "default16": 16, "default64": 64,
           "default128": 128}


def random_experts(device, num_experts: int, n: int, k: int):
    return stack_experts([prepare_mxfp4(*random_mxfp4(n, k, device)) for _ in range(num_experts)])


def random_topk_ids(device, tokens: int, top_k: int, num_experts: int, pattern: str = "random") -> torch.Tensor:
    """int [T, top_k], distinct experts per token. pattern "random"; "skip": experts 0 and E-1 get no pair;
    "same": every token's first choice is expert E-1 (with top_k 1 all pairs go to it)."""
    if pattern == "skip":
        pool = torch.arange(1, num_experts - 1)
    elif pattern == "same":
        pool = torch.arange(num_experts - 1)
    else:
        pool = torch.arange(num_experts)
    picks = top_k - 1 if pattern == "same" else top_k
    ids = torch.stack([pool[torch.randperm(len(pool))[:picks]] for _ in range(tokens)]) if tokens else \
        torch.zeros((0, picks), dtype=torch.int64)
    if pattern == "same":
        ids = torch.cat([torch.full((tokens, 1), num_experts - 1), ids.reshape(tokens, picks)], dim=1)
    return ids.to(device)


def moe_inputs(device, tokens, top_k, num_experts, n, k, source, pattern="random"):
    """(x_q, x_scale, experts, topk_ids) with fresh random values; x has one row per token or per pair."""
    experts = random_experts(device, num_experts, n, k)
    ids = random_topk_ids(device, tokens, top_k, num_experts, pattern)
    rows = tokens if source == "token" else tokens * top_k
    x_q, x_scale = quantize_activations(torch.randn(rows, k, device=device) * 2)
    return x_q, x_scale, experts, ids


def routed(ids, num_experts, tiling):
    return route_to_experts(ids, num_experts, BLOCK_M[tiling])


def check_plain(device, tokens, top_k, num_experts, n, k, tiling, source, pattern="random", out_dtype=torch.float32,
                gate=GATE):
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, n, k, source, pattern)
    out = torch.full((tokens * top_k, n), float("nan"), device=device, dtype=out_dtype)  # poisoned
    got = w4a8_moe_gemm(x_q, x_scale, experts, routed(ids, num_experts, tiling), rows_per_pair_source=source,
                        out_dtype=out_dtype, config=TILINGS[tiling], out=out)
    assert got is out
    ref = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source=source, out_dtype=torch.float32)
    err = relative_error(out, ref)
    assert err <= gate, f"T={tokens} top_k={top_k} E={num_experts} N={n} K={k} {tiling} {source}: rel {err:.2e}"


def assert_close_quantized_rows(device, got, want):
    """Kernel vs exact reference after SiLU-mul and fp8 quantization. Under the interpreter their GEMM sums
    agree to fp32 rounding, so a scale moves by an ulp and a code by one e4m3 step, rarely. On the GPU the
    fp8 MMA sums each K tile at reduced precision (gemm.py, PRECISE_ACC): the GEMM is within the 2e-3 gate
    of the reference, and a value's error is relative to its row (up to a few steps for small codes). A
    wrong row, expert or scale moves everything."""
    (got_q, got_s), (want_q, want_s) = got, want
    assert got_q.shape == want_q.shape and got_s.shape == want_s.shape
    on_gpu = device.type == "cuda"
    torch.testing.assert_close(got_s, want_s, rtol=GATE if on_gpu else 1e-5, atol=0)
    got_v, want_v = got_q.float() * got_s, want_q.float() * want_s
    # one code a step away moves a few-row tensor's norm by up to ~1.5% (an element near 64 by 8): on the GPU,
    # where such steps happen, the per-element bound below is the check that matters
    assert relative_error(got_v, want_v) <= (2e-2 if on_gpu else 1e-2)
    one_step = 2 ** -3 * want_v.abs() + 2 ** -9 * want_s  # relative for normal codes, absolute for subnormals
    row_error = 5 * GATE * 448 * want_s if on_gpu else 0  # 1% of the row's amax
    assert ((got_v - want_v).abs() <= (one_step + row_error) * 1.01).all()  # (False for NaN)
    if not on_gpu:
        differ = got_q.view(torch.uint8) != want_q.view(torch.uint8)
        assert differ.sum() <= max(2, 0.01 * differ.numel())


def check_glu(device, tokens, top_k, num_experts, inter, k, tiling, pattern="random", out_dtype=torch.float32):
    """The gate_up GEMM (x one row per token) with SiLU-mul and quantization, vs the reference."""
    x_q, x_scale, experts, ids = moe_inputs(device, tokens, top_k, num_experts, 2 * inter, k, "token", pattern)
    y = torch.full((tokens * top_k, inter), float("nan"), device=device, dtype=out_dtype)  # poisoned
    got = w4a8_moe_gemm(x_q, x_scale, experts, routed(ids, num_experts, tiling), rows_per_pair_source="token",
                        glu=True, out_dtype=out_dtype, config=TILINGS[tiling], out=y)
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == (tokens * top_k, 1)
    want = w4a8_moe_reference(x_q, x_scale, experts, ids, rows_per_pair_source="token", glu=True, out_dtype=out_dtype)
    assert_close_quantized_rows(device, got, want)
    return x_q, x_scale, experts, ids, got


# (T, top_k, E, N, K, tiling, activation rows, routing pattern): N 48 and 112 are no tile multiples, K 96
# and 160 no multiple of 128, K 416 four K tiles (the last partial); 64+ tokens
PLAIN_CASES = [
    (1, 1, 1, 48, 96, "swap16", "token", "random"),
    (2, 2, 4, 112, 416, "swap16", "pair", "random"),
    (5, 4, 8, 48, 160, "swap16", "token", "skip"),
    (17, 2, 8, 112, 160, "plain64", "token", "random"),
    (17, 4, 4, 48, 256, "default16", "pair", "same"),
    (70, 2, 4, 48, 160, "plain64", "pair", "skip"),
    (70, 1, 8, 112, 96, "swap16", "token", "same"),
    (64, 4, 8, 48, 128, "default64", "token", "random"),
    (65, 1, 4, 48, 96, "plain64", "token", "same"),
    (150, 2, 4, 112, 416, "default128", "pair", "random"),  # the 128-slot tiles, a group past one tile
    (40, 2, 8, 112, 416, "persist16", "token", "skip"),  # ~9 tiles x 2 column tiles over 4 programs
    (130, 2, 4, 48, 160, "persist64", "pair", "same"),
]


@pytest.mark.parametrize("tokens,top_k,num_experts,n,k,tiling,source,pattern", PLAIN_CASES,
                         ids=["-".join(map(str, c)) for c in PLAIN_CASES])
def test_grouped_gemm_matches_reference(device, tokens, top_k, num_experts, n, k, tiling, source, pattern):
    check_plain(device, tokens, top_k, num_experts, n, k, tiling, source, pattern)


# (T, top_k, E, I, K, tiling, pattern): the merged [gate | up] weight has N = 2I rows
GLU_CASES = [
    (1, 1, 1, 24, 96, "swap16", "random"),
    (5, 2, 4, 56, 160, "swap16", "skip"),
    (17, 4, 8, 24, 416, "plain64", "random"),
    (70, 2, 4, 56, 160, "default64", "same"),
    (64, 2, 8, 24, 256, "default16", "random"),
    (130, 2, 4, 56, 160, "default128", "skip"),
    (33, 2, 8, 56, 416, "persist16", "random"),
    (90, 2, 4, 24, 160, "persist64", "skip"),
]


@pytest.mark.parametrize("tokens,top_k,num_experts,inter,k,tiling,pattern", GLU_CASES,
                         ids=["-".join(map(str, c)) for c in GLU_CASES])
def test_grouped_glu_matches_reference(device, tokens, top_k, num_experts, inter, k, tiling, pattern):
    check_glu(device, tokens, top_k, num_experts, inter, k, tiling, pattern)


def test_grouped_glu_gives_the_dense_glu_bytes_per_expert(device):
    """Each expert's rows through the dense w4a8_glu with the same tiling: the same quantized rows (bytes
    on CUDA; under the interpreter within its ulp noise, assert_same_quantized_rows)."""
    x_q, x_scale, experts, ids, (y_q, y_s) = check_glu(device, 9, 2, 4, 40, 288, "swap16")
    dense = GemmConfig(block_m=16, block_n=64, block_k=128, swap_ab=True, num_stages=3, split_k=1)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = torch.nonzero(flat == e).flatten()
        rows = pairs // 2
        want = w4a8_glu(x_q[rows], x_scale[rows], expert_weight(experts, e), None, torch.float32, config=dense)
        assert_same_quantized_rows(device, (y_q[pairs], y_s[pairs]), want)


def test_nan_token_stays_in_its_pairs(device):
    experts = random_experts(device, 4, 48, 128)
    ids = random_topk_ids(device, 6, 2, 4)
    routing = route_to_experts(ids, 4, 16)
    x = torch.randn(6, 128, device=device)
    clean = w4a8_moe_gemm(*quantize_activations(x), experts, routing, rows_per_pair_source="token",
                          out_dtype=torch.float32)
    x[3, 5] = float("nan")
    out = w4a8_moe_gemm(*quantize_activations(x), experts, routing, rows_per_pair_source="token",
                        out_dtype=torch.float32)
    assert not torch.isfinite(out[6:8]).any()  # token 3's two pairs
    keep = [p for p in range(12) if p // 2 != 3]
    assert torch.equal(out[keep], clean[keep])


def test_no_tokens_and_default_block_m(device):
    x_q, x_scale, experts, ids = moe_inputs(device, 0, 2, 4, 48, 96, "token")
    routing = route_to_experts(ids, 4, moe_block_m(0, 4))
    assert w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="token").shape == (0, 48)
    y_q, y_s = w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="token", glu=True)
    assert y_q.shape == (0, 24) and y_s.shape == (0, 1)


def test_operand_checks(device):
    x_q, x_scale, experts, ids = moe_inputs(device, 3, 2, 4, 48, 96, "token")
    routing = route_to_experts(ids, 4, 16)
    with pytest.raises(ValueError, match="activation rows"):
        w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="pair")
    with pytest.raises(ValueError, match="rows_per_pair_source"):
        w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="tokens")
    with pytest.raises(ValueError, match="block_m"):
        w4a8_moe_gemm(x_q, x_scale, experts, routing, rows_per_pair_source="token", config=PLAIN64)
    with pytest.raises(ValueError, match="K="):
        w4a8_moe_gemm(x_q[:, :64], x_scale, experts, routing, rows_per_pair_source="token")
