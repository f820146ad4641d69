"""The embedded SmolLM2 GGUF: config, q/k layout, tokenizer and chat template, conversion."""

import os

import gguf
import numpy as np
import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.gguf_reader import unpermute_rows
from radiance.config import ConvertConfig
from radiance.formats import DenseWeight, Int4Weight, Mxfp4Weight, dequantize


@pytest.fixture(scope="module")
def smol():
    return open_checkpoint(None)


def test_synthesized_config_matches_the_model_card(smol):
    # SmolLM2-135M-Instruct: Llama, 30 layers, hidden 576, 9 heads / 3 kv heads, vocab 49152, tied embeddings
    c = smol.config
    assert smol.kind == "gguf" and c["architectures"] == ["LlamaForCausalLM"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True and c["rope_theta"] == 100000.0
    assert smol.eos_token_ids == [2] and smol.warnings == []
    names = smol.names()
    assert len(names) == 2 + 30 * 6 and "lm_head.weight" not in names


def test_qk_rows_match_transformers_gguf_loader(smol):
    """Our un-permutation against transformers' own GGUF tensor processor, on real tensors."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    by_name = smol.tensors
    weights = dict(smol.iter_weights(progress=False))
    for layer in (0, 29):
        qkv = weights[f"model.layers.{layer}.self_attn.qkv_proj"]
        assert isinstance(qkv, Int4Weight) and qkv.partition_sizes == (576, 192, 192)  # Q4_1 codes, unrounded
        ref = []
        for part in ("attn_q", "attn_k", "attn_v"):
            t = by_name[f"blk.{layer}.{part}.weight"]
            raw = gguf.quants.dequantize(t.data, t.tensor_type)
            ref.append(torch.from_numpy(np.array(processor.process(raw, t.name).weights)))
        assert torch.equal(dequantize(qkv), torch.cat(ref))
    # the permutation really moves rows (so the check above can fail)
    t = by_name["blk.0.attn_q.weight"]
    raw = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
    assert not torch.equal(unpermute_rows(raw, 9), raw)


def test_describe_names_the_format_iter_weights_yields(smol):
    formats = {e.name: e.format for e in smol.describe()}
    weights = dict(smol.iter_weights(progress=False))
    linears = [name for name, w in weights.items() if not isinstance(w, torch.Tensor)]
    assert len(linears) == 120 and all(formats[n] == weights[n].format == "int4" for n in linears)
    assert formats["model.embed_tokens.weight"] == "float32"  # Q8_0, dequantized



def test_inspect_says_which_gguf_tensors_stay_4bit(smol):
    """It said every tensor type, Q4_1 included, was dequantized to float32 at load."""
    from radiance.checkpoint.inspect import inspect_lines

    quant = next(line for line in inspect_lines(smol) if line.startswith("quant"))
    assert "GGUF Q4_1 linears stay 4-bit" in quant and "GGUF F32/Q8_0 tensors are dequantized" in quant, quant
    assert "none" not in quant and "16-bit" not in quant, quant  # a GGUF has no quantization_config: not "none"


def test_a_truncated_4bit_tensor_names_file_and_tensor(smol):
    from radiance.errors import CheckpointError

    name = "blk.3.ffn_down.weight"
    good = smol.tensors[name]
    smol.tensors[name] = good._replace(data=good.data[:, :100])
    try:
        with pytest.raises(CheckpointError, match="malformed Q4_1") as err:
            smol._linear(name)
        assert name in str(err.value) and smol.path in str(err.value)
    finally:
        smol.tensors[name] = good


def test_tokenizer_and_chat_template(smol):
    tok = smol.tokenizer()
    assert "<|im_start|>" in smol.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_convert_embedded_keeps_tokenizer_and_template(smol, tmp_path):
    # convert two layers only (the rest kept 16-bit by --ignore) to keep the test fast
    config = ConvertConfig(format="mxfp4", ignore=(r"layers\.([2-9]|[12]\d)\.",))
    report = convert_checkpoint(smol, str(tmp_path / "smol"), config, progress=False)
    assert len(report.entries) == 8 and report.kept["dense"] == 112
    # the source named is the GGUF's int4 (it said "dense": the codes are dequantized before they convert)
    assert {(e.source_format, e.target_format) for e in report.entries} == {("int4", "mxfp4")}
    assert 0.05 < report.worst.rel_rms < 0.2
    out = open_checkpoint(str(tmp_path / "smol"))
    assert out.warnings == [] and out.eos_token_ids == [2]
    assert out.chat_template == smol.chat_template
    sample = "Hello world, the capital of France is Paris."
    assert out.tokenizer().encode(sample) == smol.tokenizer().encode(sample)
    assert {"tokenizer.json", "config.json", "generation_config.json", "model.safetensors"} <= set(
        os.listdir(tmp_path / "smol"))
    got = out.state_dict()
    assert isinstance(got["model.layers.1.mlp.down_proj"], Mxfp4Weight)
    kept = got["model.layers.2.mlp.down_proj"]
    assert isinstance(kept, DenseWeight) and kept.tensor.dtype == torch.bfloat16
    src = dequantize(dict(smol.iter_weights(progress=False))["model.layers.2.mlp.down_proj"])
    assert torch.equal(kept.tensor, src.to(torch.bfloat16))
