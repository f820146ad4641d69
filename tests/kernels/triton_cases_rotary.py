"""The one-launch rotary kernel vs the torch rotation of layers/rotary.py (run on CUDA, or on the CPU
through the Triton interpreter by test_triton_interpreter.py)."""

import pytest
import torch

from radiance.layers.rotary import RotaryEmbedding, _rotate, _rotate_triton


@pytest.mark.parametrize("head_dim,q_heads,k_heads", [(64, 9, 3), (128, 32, 8)])
def test_rotary_kernel_matches_torch(device, head_dim, q_heads, k_heads):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, llama3)
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
