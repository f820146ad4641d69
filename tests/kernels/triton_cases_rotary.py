"""The one-launch rotary kernel vs the torch rotation of layers/rotary.py (run on CUDA, or on the CPU
through the Triton interpreter by test_triton_interpreter.py)."""

import pytest
import torch

from radiance.layers.rotary import RotaryEmbedding, _rotate, _rotate_triton


@pytest.mark.parametrize("head_dim,q_heads,k_heads", [(64, 9, 3), (128, 32, 8)])
# the rotated part of each head: whole, the leading half (GLM-4.5), a quarter (Qwen3.5), an eighth
@pytest.mark.parametrize("part", [1, 2, 4, 8])
def test_rotary_kernel_matches_torch(device, head_dim, q_heads, k_heads, part):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, llama3, rotary_dim=head_dim // part)
    rope = rope.to(device)
    t = 11
    positions = torch.randint(0, 4096, (t,), device=device)
    qkv = torch.randn(t, (q_heads + 2 * k_heads) * head_dim, device=device) * 3  # q and k are strided views
    q = qkv[:, : q_heads * head_dim].reshape(t, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + k_heads) * head_dim].reshape(t, k_heads, head_dim)
    q_out, k_out = _rotate_triton(positions, q, k, rope.cos, rope.sin)
    cos, sin = rope.cos[positions].unsqueeze(-2), rope.sin[positions].unsqueeze(-2)
    # fp32: the kernel may fuse a multiply-add where torch rounds twice
    assert torch.allclose(q_out, _rotate(q, cos, sin), rtol=1e-5, atol=1e-5)
    assert torch.allclose(k_out, _rotate(k, cos, sin), rtol=1e-5, atol=1e-5)
    assert q_out.shape == q.shape and k_out.is_contiguous()
    assert rope.fuses_kv_store(positions, q) == (device.type == "cuda")
    rotated = head_dim // part  # the dims past it pass through as they are
    assert torch.equal(q_out[..., rotated:], q[..., rotated:]) and torch.equal(k_out[..., rotated:], k[..., rotated:])
    if part > 1:  # a partial rotation moves the rotated dims
        assert not torch.allclose(q_out[..., :rotated], q[..., :rotated], atol=1e-3)


@pytest.mark.parametrize("head_dim,q_heads,k_heads", [(64, 9, 3), (128, 32, 8)])
def test_rotate_and_store_writes_the_cache(device, head_dim, q_heads, k_heads):
    """The fused launch: q rotated as before; rotated k and v at their cache slots, nothing written
    for a padding token (slot -1); the same cache as rotation followed by store_kv_cache_torch."""
    from radiance.layers.attention import store_kv_cache_torch

    rope = RotaryEmbedding(head_dim, 1024, 10000.0).to(device)
    t, blocks, block_size = 6, 4, 4
    positions = torch.randint(0, 1024, (t,), device=device)
    qkv = torch.randn(t, (q_heads + 2 * k_heads) * head_dim, device=device)
    q, k, v = (part.reshape(t, -1, head_dim) for part in
               qkv.split((q_heads * head_dim, k_heads * head_dim, k_heads * head_dim), dim=-1))
    slots = torch.tensor([5, 0, -1, 14, 9, 3], device=device)
    k_cache = torch.full((blocks, block_size, k_heads, head_dim), 7.0, device=device)
    v_cache = torch.full_like(k_cache, 7.0)
    q_rot = rope.rotate_and_store(positions, q, k, v, k_cache, v_cache, slots)
    ref_q, ref_k = _rotate_triton(positions, q, k, rope.cos, rope.sin)
    ref_kc, ref_vc = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    store_kv_cache_torch(ref_k, v, ref_kc, ref_vc, slots)
    assert torch.equal(q_rot, ref_q)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)
    # into a given tensor (the piecewise graphs' static queries): the same values, that tensor returned
    given = torch.full((t, q_heads, head_dim), float("nan"), device=device)
    assert rope.rotate_and_store(positions, q, k, v, k_cache, v_cache, slots, q_out=given) is given
    assert torch.equal(given, ref_q)
    with pytest.raises(ValueError, match="q_out"):
        rope.rotate_and_store(positions, q, k, v, k_cache, v_cache, slots, q_out=given[:, :, :head_dim // 2])


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("part", [1, 2, 4])
def test_fused_head_norm_matches_norm_then_rotate(device, store, part):
    """Qwen3's q_norm / k_norm inside the rotary launch: what the RMSNorm modules followed by the rotation
    give (bf16 on CUDA; fp32 under the interpreter), for the plain launch and the one writing the cache."""
    from radiance.layers.norm import RMSNorm

    head_dim, q_heads, k_heads, t = 128, 12, 4, 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rope = RotaryEmbedding(head_dim, 1024, 1000000.0, rotary_dim=head_dim // part).to(device)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(device), RMSNorm(head_dim, 1e-6).to(device)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.3 * torch.randn(head_dim)), k_norm.weight.copy_(1 + 0.3 * torch.randn(head_dim))
    positions = torch.randint(0, 1024, (t,), device=device)
    q = (torch.randn(t, q_heads, head_dim, device=device) * 4).to(dtype)
    k = (torch.randn(t, k_heads, head_dim, device=device) * 4).to(dtype)
    v = torch.randn(t, k_heads, head_dim, device=device).to(dtype)
    cos, sin = rope.cos[positions].unsqueeze(-2), rope.sin[positions].unsqueeze(-2)
    want_q, want_k = _rotate(q_norm(q), cos, sin), _rotate(k_norm(k), cos, sin)
    tol = dict(rtol=2 ** -7, atol=2 ** -7) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    if store:
        k_cache = torch.zeros(2, 4, k_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(t, device=device)
        got_q = rope.rotate_and_store(positions, q, k, v, k_cache, v_cache, slots, qk_norm=(q_norm, k_norm))
        got_k = k_cache.reshape(-1, k_heads, head_dim)[:t]
        assert torch.equal(v_cache.reshape(-1, k_heads, head_dim)[:t], v)
    else:
        got_q, got_k = _rotate_triton(positions, q, k, rope.cos, rope.sin, qk_norm=(q_norm, k_norm))
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert not torch.allclose(got_q.float(), _rotate_triton(positions, q, k, rope.cos, rope.sin)[0].float(), atol=0.1)


@pytest.mark.parametrize("splits", [(1, 3)])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_fused_rotary_decode_of_partial_heads(device, splits, rotary_dim):
    """A partial rotary inside the decode attention kernel, which rotates q and stores the new K/V itself (the
    leading half of each head, GLM-4.5's; a quarter, Qwen3.5's): the same bytes as the rotary launch then
    attention, and torch's."""
    from tests.engine.test_attention_triton import check_fused_decode

    errors = check_fused_decode(device.type, torch.float32, heads=6, kv_heads=2, head_dim=32, splits=splits,
                                seed=7, rotary_dim=rotary_dim)
    assert errors["cache_differs"] == 0.0 and errors["out_differs"] == 0.0, errors
    assert errors["out_vs_torch"] < 1e-5 and errors["cache_vs_torch"] < 1e-6, errors
