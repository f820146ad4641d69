"""gpt-oss GGUF files as llama.cpp writes them: the experts in ggml's MXFP4 blocks (the e8m0 exponent, then the low
nibbles of 16 code bytes for weights 0-15 and the high ones for 16-31), gate and up apart (or fused), their biases,
the router with its bias, the attention sinks, YaRN without truncation: served as MXFP4 with no requantization,
the logits of the transformers checkpoint quantized to the same codes at load."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.gguf_blocks import mxfp4_from_blocks
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.formats import Mxfp4Weight, dequantize, quantize_mxfp4
from radiance.models.registry import resolve_architecture
from tests.engine.gguf_files import TOP, write_gguf

MXFP4 = gguf.GGMLQuantizationType.MXFP4
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def ggml_blocks(w: torch.Tensor) -> np.ndarray:
    """[..., rows, cols] float -> ggml MXFP4 bytes [..., rows, cols / 32 * 17] of radiance's own quantization."""
    lead, (rows, cols) = w.shape[:-2], w.shape[-2:]
    packed, scale = quantize_mxfp4(w.reshape(-1, cols).float(), "mse")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(-1, cols // 32, 32)  # weight order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    blocks = torch.cat((scale.reshape(-1, cols // 32, 1), qs), dim=-1).to(torch.uint8)
    return blocks.reshape(*lead, rows, cols // 32 * 17).numpy()


def test_ggml_blocks_read_back_as_the_same_codes():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    blocks = ggml_blocks(w)
    ours = mxfp4_from_blocks(blocks, 6, 64)
    assert torch.equal(dequantize(ours), dequantize(Mxfp4Weight(*quantize_mxfp4(w, "mse"))))
    assert torch.equal(dequantize(ours), torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4)))  # ggml's reading


def write_gpt_oss_gguf(hf, path, fused: bool = False) -> str:
    """The tiny HF gpt-oss as llama.cpp's converter writes it: the experts in MXFP4 (radiance's own quantization of
    them, in ggml's blocks), gate and up apart or `fused`, the rest float32."""
    c = hf.config
    rope = c.rope_parameters
    metadata = {"gpt-oss.attention.sliding_window": c.sliding_window, "gpt-oss.expert_count": c.num_local_experts,
                "gpt-oss.expert_used_count": c.num_experts_per_tok,
                "gpt-oss.expert_feed_forward_length": c.intermediate_size, "gpt-oss.rope.scaling.type": "yarn",
                "gpt-oss.rope.scaling.factor": float(rope["factor"]),
                "gpt-oss.rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
    tensors = {}
    for name, tensor in hf.state_dict().items():
        values = tensor.float()
        if not name.startswith("model.layers."):
            tensors[TOP[name]] = values.numpy()
            continue
        _, _, i, rest = name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        if module == "mlp.experts":  # transformers' [E, K, N] with gate and up interleaved along N
            if leaf in ("gate_up_proj", "gate_up_proj_bias"):
                gate, up = values[..., 0::2], values[..., 1::2]
                if leaf == "gate_up_proj":
                    gate, up = gate.transpose(1, 2), up.transpose(1, 2)
                parts = {"gate_up": torch.cat((gate, up), dim=1)} if fused else {"gate": gate, "up": up}
            else:
                parts = {"down": values.transpose(1, 2) if leaf == "down_proj" else values}
            for proj, part in parts.items():
                if leaf.endswith("_bias"):
                    tensors[f"blk.{i}.ffn_{proj}_exps.bias"] = part.numpy()
                else:
                    tensors[f"blk.{i}.ffn_{proj}_exps.weight"] = ggml_blocks(part)
        elif module == "self_attn" and leaf == "sinks":
            tensors[f"blk.{i}.attn_sinks.weight"] = values.numpy()
        else:
            tensors[f"blk.{i}.{BLOCK[module]}.{leaf}"] = values.numpy()
    raw = {name: MXFP4 for name in tensors if name.endswith("_exps.weight")}
    return write_gguf(path, "gpt-oss", c, tensors, metadata, head_dim=c.head_dim, raw_types=raw)


@pytest.mark.parametrize("fused", [False, True], ids=["gate-and-up", "fused-gate-up"])
def test_a_gpt_oss_gguf_serves_its_mxfp4_experts_as_they_are(tiny_model_dir, tmp_path, fused):
    path, hf = tiny_model_dir("gptoss")
    ckpt = open_checkpoint(write_gpt_oss_gguf(hf, tmp_path / "g.gguf", fused))
    cls, cfg = resolve_architecture(ckpt.config)
    assert cls.__name__ == "GptOssForCausalLM" and cfg.attention_sinks and cfg.moe.router_bias
    assert cfg.sliding_layers == {0} and cfg.rope_scaling["truncate"] is False
    formats = {e.name: e.format for e in ckpt.describe()}
    assert formats["model.layers.1.mlp.experts.7.gate_up_proj"] == "mxfp4"
    from radiance.checkpoint.inspect import inspect_lines
    assert any(line.startswith("quant      GGUF MXFP4 linears are served as MXFP4") for line in inspect_lines(ckpt))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    # both with the attention's 16-bit linears quantized too, so that only the experts' route differs
    served = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4"), checkpoint=ckpt,
                        progress=False)
    requant = next(line for line in served.summary if line.startswith("requant"))
    assert "experts" not in requant  # the experts arrive in MXFP4: only qkv and o are converted
    reference = open_checkpoint(path)
    # the GGUF carries no SwiGLU limit: gpt-oss's 7 (llama.cpp's and GptOssConfig's), not the tiny model's 1
    assert cfg.moe.activation.limit == 7.0
    reference.config = dict(reference.config, swiglu_limit=7.0)
    at_load = load_model(ModelConfig(device="cpu", dtype="float32", quantization="mxfp4"), checkpoint=reference,
                         progress=False)
    assert torch.equal(served.model.forward_logits(ids), at_load.model.forward_logits(ids))
