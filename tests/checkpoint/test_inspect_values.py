"""`radiance inspect --values` reads every weight and names each one a load would refuse (the rest of inspect reads
headers only, so a NaN weight passed --strict and was refused by the next generate)."""

from __future__ import annotations

import os

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.values import value_warnings
from radiance.cli import main
from tests.checkpoint.factory import CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict, linear_modules, write_dir

V_PROJ = "model.layers.1.self_attn.v_proj.weight"  # served merged as qkv_proj: named as stored
NORM = "model.layers.0.post_attention_layernorm.weight"


def _model(tmp_path, nan_in=(), inf_in=()) -> str:
    tensors = dense_state_dict()
    for name in nan_in:
        tensors[name].view(-1)[3] = float("nan")
    for name in inf_in:
        tensors[name].view(-1)[:2] = float("inf")
    return write_dir(str(tmp_path / "m"), tensors, TINY, tokenizer=True)


def test_a_clean_checkpoint_reads_all_finite(tmp_path, capsys):
    path = _model(tmp_path)
    assert main(["inspect", path, "--values", "--strict", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "values     15 weights read: all finite" in out and "warnings   none" in out


def test_every_faulty_tensor_is_named_as_stored_and_strict_fails(tmp_path, capsys):
    path = _model(tmp_path, nan_in=[V_PROJ], inf_in=[NORM])
    assert main(["inspect", path, "--values", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "values     15 weights read: 2 faulty (warnings)" in out
    shard = os.path.join(path, "model.safetensors")
    assert f"  - 1 NaN or inf value(s) (file {shard}, tensor {V_PROJ})" in out
    assert f"  - 2 NaN or inf value(s) (file {shard}, tensor {NORM})" in out
    assert main(["inspect", path, "--values", "--strict", "--no-progress"]) == 1
    capsys.readouterr()
    assert main(["inspect", path, "--strict"]) == 0  # headers alone see nothing: why --values exists


def test_a_quantized_checkpoint_is_read_in_its_format(tmp_path):
    tensors = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    tensors["model.norm.weight"][5] = float("nan")
    path = write_dir(str(tmp_path / "m"), tensors, TINY, CT_NVFP4_CONFIG, tokenizer=True)
    read, warnings = value_warnings(open_checkpoint(path), progress=False)
    assert read == 15 and len(warnings) == 1 and "tensor model.norm.weight)" in warnings[0], warnings


def test_a_scale_the_reader_refuses_is_listed_with_its_words(tmp_path):
    tensors = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    scale = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[scale] = tensors[scale].view(torch.uint8).clone().fill_(0xFF).view(torch.float8_e4m3fn)  # NaN scales
    path = write_dir(str(tmp_path / "m"), tensors, TINY, CT_NVFP4_CONFIG, tokenizer=True)
    _, warnings = value_warnings(open_checkpoint(path), progress=False)
    assert len(warnings) == 1 and warnings[0].startswith("a load refuses it: ") and "down_proj" in warnings[0], warnings


def test_a_gguf_is_read_entry_by_entry_past_a_refused_tensor(tmp_path):
    """A GGUF tensor the reader refuses (malformed blocks) is listed and the pass reads on to the end (it stopped at the
    first, so later faults went unnamed)."""
    import gguf

    from tests.checkpoint.test_gguf_metadata import write_gguf

    q4 = gguf.GGMLQuantizationType.Q4_0
    path = tmp_path / "m.gguf"
    write_gguf(path, types={"blk.0.ffn_down.weight": q4, "blk.0.attn_v.weight": q4}, nan_in="blk.0.ffn_norm.weight")
    ckpt = open_checkpoint(str(path))
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_v.weight"):  # truncated blocks, past the header checks
        ckpt.tensors[name] = ckpt.tensors[name]._replace(data=ckpt.tensors[name].data[:, :10])
    read, warnings = value_warnings(ckpt, progress=False)
    assert read == len(list(ckpt._plan()))
    refused = sorted(w.split("tensor ")[-1] for w in warnings if w.startswith("a load refuses it: malformed Q4_0"))
    assert refused == ["blk.0.attn_v.weight)", "blk.0.ffn_down.weight)"], warnings
    assert any("NaN" in w and "blk.0.ffn_norm.weight" in w for w in warnings), warnings


def test_an_mxfp4_scale_past_float32_is_listed_and_a_load_refuses_it(tmp_path):
    """An e8m0 scale byte of 254 (2^127) makes inf values: a load gave NaN logits and an empty answer with exit 0;
    now --values lists it as a load's refusal, and the load names file and tensor."""
    from radiance.config import ModelConfig
    from radiance.engine.loader import load_model
    from radiance.errors import CheckpointError
    from tests.checkpoint.factory import CT_MXFP4_CONFIG, ct_mxfp4_tensors

    tensors = ct_mxfp4_tensors(dense_state_dict(), linear_modules())
    scale = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[scale][3, 0] = 254
    path = write_dir(str(tmp_path / "m"), tensors, TINY, CT_MXFP4_CONFIG, tokenizer=True)
    _, warnings = value_warnings(open_checkpoint(path), progress=False)
    assert len(warnings) == 1 and warnings[0].startswith("a load refuses it: MXFP4 scale byte 254"), warnings
    assert "tensor model.layers.0.mlp.up_proj.weight)" in warnings[0]
    with pytest.raises(CheckpointError, match=r"scale byte 254 .*tensor model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(ModelConfig(device="cpu"), checkpoint=open_checkpoint(path), progress=False)


def test_a_tokenizer_larger_than_the_vocabulary_is_a_warning(tmp_path, capsys):
    """300 tokens for a 128-row embedding passed `inspect --tokenizer --strict` and failed at request time; a
    tokenizer no larger than the vocabulary (padded embeddings are common) stays clean."""
    from tests.checkpoint.factory import write_tokenizer

    path = _model(tmp_path)
    assert main(["inspect", path, "--tokenizer", "--strict"]) == 0
    write_tokenizer(path, 300)
    capsys.readouterr()
    assert main(["inspect", path, "--tokenizer", "--strict"]) == 1
    assert "the tokenizer has 300 tokens, the model's vocabulary 128" in capsys.readouterr().out


def test_a_tied_model_storing_another_head_is_a_warning_of_values(tmp_path):
    """tie_word_embeddings with a stored lm_head.weight unlike the embeddings: the load warned, `inspect --values
    --strict` passed; the same head as the embeddings stays clean."""
    tensors = dense_state_dict()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    same = write_dir(str(tmp_path / "same"), tensors, {**TINY, "tie_word_embeddings": True}, tokenizer=True)
    assert value_warnings(open_checkpoint(same), progress=False)[1] == []
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    other = write_dir(str(tmp_path / "other"), tensors, {**TINY, "tie_word_embeddings": True}, tokenizer=True)
    warnings = value_warnings(open_checkpoint(other), progress=False)[1]
    assert len(warnings) == 1 and "an lm_head.weight differs from the embeddings" in warnings[0], warnings
