"""The torch attention path (CPU): KV stores that skip padded rows, float32 decode attention for 16-bit
models, the float32 cache read in place, rotary cos/sin shared by the layers of one forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radiance.engine.kv_cache import kv_cache_dtype
from radiance.layers.attention import cached_kv, paged_attention_torch, store_kv_cache_torch
from radiance.layers.rotary import RotaryEmbedding


def dense_attention(q, k, v, scale):
    """One query per head against all keys, GQA by repetition, float64."""
    group = q.shape[-2] // k.shape[-2]
    k, v = k.double().repeat_interleave(group, -2), v.double().repeat_interleave(group, -2)
    p = torch.einsum("hd,thd->ht", q.double(), k).mul(scale).softmax(-1)
    return torch.einsum("ht,thd->hd", p, v)


def test_store_skips_minus_one_slots_and_writes_the_rest():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_cache_torch(k, v, k_cache, v_cache, torch.tensor([5, -1, 9]))
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[9], k[2]) and torch.equal(flat_v[9], v[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # the -1 row went nowhere
    store_kv_cache_torch(k, v, k_cache, v_cache, torch.tensor([0, 1, 2]))  # all valid: the direct path
    assert torch.equal(flat_k[:3], k) and torch.equal(flat_v[:3], v)
    store_kv_cache_torch(v, k, k_cache, v_cache, torch.tensor([12, 13, 14]), slots_valid=True)  # no check
    assert torch.equal(flat_k[12:15], v) and torch.equal(flat_v[12:15], k)


def test_bf16_decode_attention_matches_float64():
    torch.manual_seed(0)
    heads, kv_heads, dim, block, length = 6, 2, 16, 4, 11
    k_cache = torch.randn(8, block, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    q = torch.randn(1, heads, dim, dtype=torch.bfloat16)
    out = paged_attention_torch(q, k_cache, v_cache, table, [1], [length], dim ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (1, heads, dim)
    k = k_cache[table[0].long()].reshape(-1, kv_heads, dim)[:length]
    v = v_cache[table[0].long()].reshape(-1, kv_heads, dim)[:length]
    expected = dense_attention(q[0], k, v, dim ** -0.5)
    # float32 math, one rounding to bf16 at the end
    assert torch.allclose(out[0].double(), expected, rtol=2 ** -8, atol=1e-3)


def test_rotary_step_shares_cos_sin_only_for_its_positions():
    rope = RotaryEmbedding(16, 64, 10000.0)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    positions, other = torch.tensor([3, 9, 40]), torch.tensor([1, 2, 3])
    plain = rope(positions, q, k)
    with rope.step(positions):
        shared = rope(positions, q, k)  # a few tokens: per-token rotation matrices, the same two products
        different = rope(other, q, k)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(plain, shared))
    assert all(torch.equal(a, b) for a, b in zip(rope(other, q, k), different))
    assert not torch.equal(plain[0], different[0])
    assert rope._step is None  # nothing outlives the forward
    # q and k rotated together give what rotating each alone gives
    from radiance.layers.rotary import _rotate
    cos, sin = rope.cos[positions].unsqueeze(-2), rope.sin[positions].unsqueeze(-2)
    assert torch.equal(plain[0], _rotate(q, cos, sin)) and torch.equal(plain[1], _rotate(k, cos, sin))


def test_single_decode_fast_path_matches_the_batched_loop():
    """One sequence decoding (the CPU's usual step) returns what the same row gets in a batch of two."""
    torch.manual_seed(1)
    k_cache = torch.randn(8, 4, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.tensor([[5, 2, 7], [1, 3, 0]], dtype=torch.int32)
    q = torch.randn(2, 6, 16, dtype=torch.bfloat16)
    both = paged_attention_torch(q, k_cache, v_cache, tables, [1, 1], [11, 6], 0.25)
    alone = paged_attention_torch(q[:1], k_cache, v_cache, tables[:1], [1], [11], 0.25)
    assert torch.equal(alone, both[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16, 17])
def test_rotation_matrices_match_the_elementwise_rotation(dtype, tokens):
    """Inside a forward (`step`), up to 16 tokens rotate with one matmul of per-token matrices; more tokens
    keep the elementwise chain. Both rotate alike: fp32 to a few ulps, bf16 to its rounding."""
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(64, 4096, 500000.0)
    positions = torch.randint(0, 4096, (tokens,))
    q, k = torch.randn(tokens, 9, 64, dtype=dtype), torch.randn(tokens, 3, 64, dtype=dtype)
    outside = rope(positions, q, k)
    with rope.step(positions):
        assert (rope._step[3] is not None) == (tokens <= 16)
        inside = rope(positions, q, k)
    for a, b in zip(outside, inside):
        assert a.dtype == b.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
        else:  # one bf16 rounding of values that may differ in the last fp32 bit: at most one bf16 ulp apart
            assert ((a.float() - b.float()).abs() <= a.float().abs() * 2 ** -7 + 1e-6).all()


def _caches(dtype, blocks=10, block=4, kv_heads=2, dim=16):
    torch.manual_seed(1)
    k = torch.randn(blocks, block, kv_heads, dim).to(torch.bfloat16)
    v = torch.randn_like(k)
    return k.to(dtype), v.to(dtype)


def test_the_cpu_cache_is_float32_and_stores_16_bit_values_exactly():
    assert kv_cache_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8).to(torch.bfloat16), torch.randn(3, 2, 8).to(torch.bfloat16)
    store_kv_cache_torch(k, v, k_cache, v_cache, torch.tensor([1, 6, 11]), slots_valid=True)
    assert torch.equal(k_cache.view(-1, 2, 8)[[1, 6, 11]], k.float())
    assert torch.equal(v_cache.view(-1, 2, 8)[[1, 6, 11]], v.float())


def test_in_place_read_is_the_gathered_context():
    k_cache, _ = _caches(torch.float32)
    table = torch.tensor([3, 4, 5, 6], dtype=torch.int32)
    view = cached_kv(k_cache, table, 14, first_block=3)
    assert torch.equal(view, cached_kv(k_cache, table, 14)) and view.data_ptr() == k_cache[3].data_ptr()


@pytest.mark.parametrize("q_lens,kv_lens", [([1], [14]), ([1, 1], [14, 7]), ([5], [14]), ([14], [14])],
                         ids=["decode", "decode-batch", "chunked-prefill", "prefill"])
def test_float32_cache_in_place_gives_the_16_bit_cache_bytes(q_lens, kv_lens):
    """Every path of paged_attention_torch on the float32 cache (read in place where the blocks run in
    order) returns exactly what it returns on a bf16 cache holding the same values."""
    k16, v16 = _caches(torch.bfloat16)
    k32, v32 = k16.float(), v16.float()
    tables = torch.tensor([[3, 4, 5, 6], [8, 1, 0, 0]], dtype=torch.int32)[:len(q_lens)]
    firsts = [3, -1][:len(q_lens)]  # the second sequence's blocks are out of order: gathered
    q = torch.randn(sum(q_lens), 4, 16).to(torch.bfloat16)
    want = paged_attention_torch(q, k16, v16, tables, q_lens, kv_lens, 0.25)
    got = paged_attention_torch(q, k32, v32, tables, q_lens, kv_lens, 0.25, firsts)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_runner_finds_the_sequences_whose_blocks_run_in_order():
    from radiance.engine.step_inputs import StepInputs

    tables = np.array([[7, 8, 9, 0], [2, 5, 6, 0], [4, 0, 0, 0], [3, 4, 9, 9]], dtype=np.int32)
    # 9 tokens: blocks 7-9; 9 tokens over 2, 5, 6: out of order; 1 token; 8 tokens: blocks 3-4 (the rest unused)
    assert StepInputs(4, 1, torch.device("cpu")).first_blocks_in_order(tables, [9, 9, 1, 8]) == [7, -1, 4, 3]
    assert StepInputs(4, 1, torch.device("cuda")).first_blocks_in_order(tables, [9, 9, 1, 8]) is None
