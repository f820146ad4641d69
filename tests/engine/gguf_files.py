"""GGUF files of tiny transformers models as llama.cpp's converters write them: llama.cpp's tensor names, its q / k row
order where its converter permutes them (Llama's), norm weights shifted where it stores 1 + weight (Gemma's), and the
metadata of each architecture. The tests then check radiance reads them back to transformers' logits."""

from __future__ import annotations

import gguf
import numpy as np
import torch

# llama.cpp's names of a Llama-style layer's modules, and of the tensors outside the layers
LLAMA_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",  # a sparse MLP's router
               # Qwen2-MoE's shared expert and its gate
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
# Gemma's four norms: ffn_norm is the one before the MLP, two more norm the attention's and the MLP's outputs
GEMMA_BLOCK = {**LLAMA_BLOCK, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def llama_cpp_permuted(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q / k row order (each head's two rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(hf, block: dict, permute: bool = False, norm_shift: float = 0.0) -> dict[str, np.ndarray]:
    """The model's float32 tensors under llama.cpp's names ({module: name} for a layer's modules, `block`); a tied
    head is left out as llama.cpp leaves it. `permute`: q / k rows in llama.cpp's rotary order (Llama's converter);
    `norm_shift`: added to every norm weight (Gemma's stored 1 + weight). A sparse MLP's experts (transformers' fused
    [experts, 2 x rows, cols] gate | up and [experts, cols, rows] down) become llama.cpp's stacked ffn_*_exps."""
    c = hf.config
    tensors = {}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            if module == "mlp.experts":
                values = tensor.float().numpy()
                if leaf == "gate_up_proj":
                    gate, up = np.split(values, 2, axis=1)
                    tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = gate, up
                else:
                    tensors[f"blk.{i}.ffn_down_exps.weight"] = values
                continue
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
                tensor = llama_cpp_permuted(tensor, heads)
            name = f"blk.{i}.{block[module]}.{leaf}"
        else:
            name = TOP[name]
        values = tensor.float().numpy()
        tensors[name] = values + norm_shift if norm_shift and name.endswith("norm.weight") else values
    return tensors


def write_gguf(path, arch: str, config, tensors: dict[str, np.ndarray], metadata: dict | None = None,
               head_dim: int | None = None, rope_theta: float | None = None,
               raw_types: dict[str, gguf.GGMLQuantizationType] | None = None) -> str:
    """A GGUF of `arch`: the sizes of the transformers `config` (key / value length when `head_dim` is given, the
    rope base `rope_theta` or the config's), `metadata` {key: value} (floats as float32, ints as uint32, strings,
    lists as arrays), then `tensors` (float32, or the raw blocks of the type `raw_types` names)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta if rope_theta is not None else config.rope_parameters["rope_theta"])
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    for key, value in (metadata or {}).items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32, bool: writer.add_bool,
         list: writer.add_array}[type(value)](key, value)
    for name, values in tensors.items():
        if name in (raw_types or {}):
            writer.add_tensor(name, values, raw_dtype=raw_types[name])
        else:
            writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
