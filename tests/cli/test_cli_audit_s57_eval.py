"""The s57 audit's findings on --ignore and `radiance eval`:
1. --ignore takes Hugging Face module names (q_proj, gate_proj) as vLLM's and compressed-tensors' ignore lists do; a
   pattern selecting only some parts of a fused linear is an error; one matching no linear is warned about.
2. `eval` opens the checkpoint and builds its tokenizer once (ppl opened it twice, kl three times).
3. `eval` labels a pre-quantized checkpoint by what was served, not as the 16-bit model or with a rule never applied.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

import radiance.checkpoint
import radiance.checkpoint.hf_reader
from radiance.bench.quality import Variant, stored_linear_formats
from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.convert import IgnoreSelection, selects
from radiance.checkpoint.writer import convert_checkpoint
from radiance.cli import main
from radiance.config import ConvertConfig, ModelConfig
from radiance.errors import ConfigError
from radiance.layers.linear import DenseLinear, Mxfp4Linear
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

QKV = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.1.mlp.gate_up_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The tiny 16-bit Llama with a word-level tokenizer (words w3 .. w127)."""
    return write_dir(str(tmp_path_factory.mktemp("tiny") / "hf"), dense_state_dict(), TINY, tokenizer=True)


@pytest.fixture(scope="module")
def tiny_mxfp4(tiny, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("tiny_mxfp4") / "out")
    convert_checkpoint(tiny, dst, ConvertConfig(format="mxfp4"), progress=False)
    return dst


@pytest.fixture(scope="module")
def tiny_nvfp4(tiny, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("tiny_nvfp4") / "out")
    convert_checkpoint(tiny, dst, ConvertConfig(format="nvfp4"), progress=False)
    return dst


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(f"w{3 + (i * 7) % 120}" for i in range(400)))
    return str(path)


def _error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    return next(line for line in err.splitlines() if line.startswith(f"radiance {command}: error:"))


# ------------------------------------------------------------------------------ 1. --ignore and HF module names


@pytest.mark.parametrize("patterns, name, partitions", [
    ((r"[qkv]_proj",), QKV, 3),  # the HF names of every part
    (("q_proj", "k_proj", "v_proj"), QKV, 3),  # every part, one pattern each
    (("qkv_proj",), QKV, 3),  # radiance's merged name
    (("gate_proj", "up_proj"), GATE_UP, 2),
    ((r"layers\.0\.",), QKV, 3),
    (("v_proj",), "model.layers.0.self_attn.qkv_proj", 1),  # Phi-3 stores it whole: its HF name is qkv_proj
    (("o_proj",), "model.layers.0.self_attn.o_proj", 1),
])
def test_ignore_selects_a_fused_linear_by_its_parts_hf_names(patterns, name, partitions):
    assert selects(patterns, name, partitions)


@pytest.mark.parametrize("patterns, name, selected, rest", [
    (("q_proj",), QKV, "q_proj", "k_proj, v_proj"),  # matched nothing: all of q/k/v were quantized, silently
    (("v_proj",), QKV, "v_proj", "q_proj, k_proj"),  # matched "qkv_proj": all of q/k/v kept 16-bit, silently
    (("q_proj", "k_proj"), QKV, "q_proj, k_proj", "v_proj"),
    (("up_proj",), GATE_UP, "up_proj", "gate_proj"),
    ((r"layers\.0\.self_attn\.k",), QKV, "k_proj", "q_proj, v_proj"),
])
def test_ignore_selecting_some_parts_of_a_fused_linear_is_an_error(patterns, name, selected, rest):
    with pytest.raises(ConfigError) as info:
        selects(patterns, name, len(rest.split(", ")) + len(selected.split(", ")))
    message = str(info.value)
    assert f"select {selected} but not {rest} of {name}" in message and "fused" in message
    assert f"got ignore {list(patterns)}" in message


def test_ignore_selection_knows_the_patterns_that_matched_no_linear():
    selection = IgnoreSelection(("qproj", "o_proj", "lm_head"))
    for name in (QKV, "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        selection(name, None)
    assert selection.unmatched() == ["qproj", "lm_head"]
    selection("lm_head", 1)
    assert selection.unmatched() == ["qproj"]


def test_convert_ignore_with_hf_names(tiny, tmp_path, capsys):
    """`--ignore q_proj` converted every linear without a word; `--ignore v_proj` kept all of q/k/v 16-bit."""
    for pattern, selected in (("q_proj", "q_proj"), ("v_proj", "v_proj")):
        dst = tmp_path / pattern
        assert main(["convert", tiny, str(dst), "--ignore", pattern, "--no-progress"]) == 2
        assert f"select {selected} but not" in _error(capsys, "convert") and not dst.exists()
    dst = tmp_path / "qkv"
    assert main(["convert", tiny, str(dst), "--ignore", r"[qkv]_proj", "--no-progress"]) == 0
    ignore = json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head"] + [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"]


def test_convert_warns_of_an_ignore_pattern_that_matches_no_linear(tiny, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="radiance.checkpoint.convert"):
        convert_checkpoint(tiny, str(tmp_path / "a"), ConvertConfig(ignore=("qproj", "lm_head", "o_proj")),
                           progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.name == "radiance.checkpoint.convert"]
    assert len(warnings) == 1 and "ignore pattern 'qproj' matches no linear" in warnings[0]


def test_quantizing_at_load_takes_hf_names_and_refuses_a_split_fused_linear(tiny):
    from radiance.engine.loader import load_model

    config = ModelConfig(model=tiny, device="cpu", dtype="float32", quantization="mxfp4", ignore=(r"[qk]_proj",))
    with pytest.raises(ValueError, match=r"select q_proj, k_proj but not v_proj of model\.layers\.0\.self_attn"):
        load_model(config, progress=False)
    model = load_model(ModelConfig(model=tiny, device="cpu", dtype="float32", quantization="mxfp4",
                                   ignore=("gate_proj", "up_proj")), progress=False).model
    mlp, attn = model.get_submodule("model.layers.1.mlp"), model.get_submodule("model.layers.1.self_attn")
    assert isinstance(mlp.gate_up_proj, DenseLinear)  # matched nothing before: quantized
    assert isinstance(mlp.down_proj, Mxfp4Linear) and isinstance(attn.qkv_proj, Mxfp4Linear)


def test_quantizing_at_load_warns_of_an_ignore_pattern_that_matches_no_linear(tiny, caplog):
    from radiance.engine.loader import load_model

    config = ModelConfig(model=tiny, device="cpu", dtype="float32", quantization="mxfp4",
                         ignore=("qproj", "down_proj"))
    with caplog.at_level(logging.WARNING, logger="radiance.checkpoint.convert"):
        load_model(config, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "matches no linear" in r.getMessage()]
    assert len(warnings) == 1 and "ignore pattern 'qproj'" in warnings[0]


# ------------------------------------------------------------------------------ 2. eval opens the checkpoint once


@pytest.fixture
def counted(monkeypatch):
    """Counts checkpoint opens and tokenizer builds."""
    counts = {"opens": 0, "tokenizers": 0}
    real_open, real_tokenizer = radiance.checkpoint.open_checkpoint, radiance.checkpoint.hf_reader.load_tokenizer

    def open_counted(*args, **kwargs):
        counts["opens"] += 1
        return real_open(*args, **kwargs)

    def tokenizer_counted(*args, **kwargs):
        counts["tokenizers"] += 1
        return real_tokenizer(*args, **kwargs)

    monkeypatch.setattr(radiance.checkpoint, "open_checkpoint", open_counted)
    monkeypatch.setattr(radiance.checkpoint.hf_reader, "load_tokenizer", tokenizer_counted)
    return counts


@pytest.mark.parametrize("mode, flags", [("ppl", []), ("kl", ["--variants", "mxfp4", "none+fp8kv"])])
def test_eval_opens_the_checkpoint_and_builds_its_tokenizer_once(counted, tiny, text, capsys, mode, flags):
    assert main(["eval", mode, tiny, "--text", text, "--chunks", "2", "--chunk-len", "16", "--device", "cpu",
                 "--json", "--no-progress", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == 2
    assert counted == {"opens": 1, "tokenizers": 1}  # ppl: 2 of each, kl (reference and two variants): 4


def test_eval_loads_outside_a_shared_scope_open_their_own(counted, tiny):
    from radiance.bench.loading import load_eval_model, shared_checkpoints

    for _ in range(2):
        load_eval_model(tiny, Variant("none"), "cpu", None, progress=False)
    assert counted["opens"] == 2
    with shared_checkpoints():
        for _ in range(2):
            load_eval_model(tiny, Variant("none"), "cpu", None, progress=False)
    assert counted == {"opens": 3, "tokenizers": 3}


# ------------------------------------------------------------------------------ 3. labels of what was served


def _eval_json(capsys, mode: str, model: str, text: str, *flags: str) -> dict:
    assert main(["eval", mode, model, "--text", text, "--chunks", "2", "--chunk-len", "16", "--device", "cpu",
                 "--json", "--no-progress", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_of_an_mxfp4_checkpoint_says_what_was_served(tiny, tiny_mxfp4, text, capsys):
    out = _eval_json(capsys, "ppl", tiny_mxfp4, text)
    assert out["results"][0]["label"] == "float32 (dequantized mxfp4)"  # was "float32", the 16-bit model's
    assert _eval_json(capsys, "ppl", tiny, text)["results"][0]["label"] == "float32"
    out = _eval_json(capsys, "kl", tiny_mxfp4, text, "--variants", "mxfp4", "nvfp4/none", "mxfp4/ocp+head")
    labels = [r["label"] for r in out["results"]]
    # served as stored, not with the rule mse; W4A16 of the MXFP4 values; the 16-bit head quantized with ocp
    assert labels == ["mxfp4 as stored W4A8", "nvfp4 as W4A16 (dequantized mxfp4)", "mxfp4 ocp W4A8 +4-bit head"]
    assert out["reference_label"] == "float32 (dequantized mxfp4)"
    assert out["results"][1]["kl"] == 0  # the W4A16 variant is the reference itself: its label says so now
    assert {"ppl", "kl", "reference_ppl", "dtype", "results"} <= set(out)


def test_eval_of_an_nvfp4_checkpoint_names_the_requantization(tiny_nvfp4, text, capsys):
    out = _eval_json(capsys, "kl", tiny_nvfp4, text, "--variants", "mxfp4", "nvfp4/none")
    assert [r["label"] for r in out["results"]] == ["nvfp4->mxfp4 mse W4A8", "nvfp4 as W4A16"]
    assert out["reference_label"] == "float32 (dequantized nvfp4)"


def test_the_embedded_gguf_is_labelled_by_its_quantized_type():
    stored = stored_linear_formats(open_checkpoint(None))
    assert set(stored.values()) == {"Q4_1"}
    assert Variant("none").label_in("float32", stored) == "float32 (dequantized Q4_1)"
    assert Variant("mxfp4").label_in("float32", stored) == "Q4_1->mxfp4 mse W4A8"
    assert Variant("nvfp4").label_in("float32", stored) == "Q4_1->nvfp4->mxfp4 mse W4A8"
    assert Variant("nvfp4", "none").label_in("float32", stored) == "nvfp4 as W4A16 (from Q4_1)"
    # a 16-bit checkpoint keeps the labels it had
    sixteen = {name: "16-bit" for name in stored}
    for spec in ("none", "mxfp4", "nvfp4/ocp/bf16+head", "nvfp4/none+fp8kv"):
        variant = Variant.parse(spec)
        assert variant.label_in(None, sixteen) == variant.label_in(None) == variant.label
    assert os.path.basename(open_checkpoint(None).path).endswith(".gguf")


# ------------------------------------------------------------------------------ 4. README: bench serve's refused flags


def test_readme_lists_only_refused_flags_as_refused():
    """The README named --goodput among the vLLM flags `bench serve` refuses; it computes request_goodput."""
    import re

    from radiance.bench import vllm_serve_args

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    sentence = re.search(r"A vLLM flag radiance cannot honour \(([^)]*)\)", readme.replace("\n", " "))
    assert sentence is not None
    named = re.findall(r"`(--[a-z-]+)", sentence.group(1))
    refused = {**vllm_serve_args._VLLM_REFUSED, **vllm_serve_args._VLLM_AT_DEFAULT}
    assert named and all(flag in refused for flag in named), named
    assert "--goodput" in readme and "--goodput" not in refused


def test_ignore_serves_a_linear_stored_quantized_as_its_values(tmp_path):
    """--ignore on an NVFP4 checkpoint: the linears it selects are served 16-bit as their dequantized NVFP4 values
    (the summary counts them nvfp4-dequant), the rest requantized to MXFP4 as before."""
    import torch

    from radiance.engine.loader import load_model
    from radiance.formats import dequantize
    from tests.checkpoint.factory import CT_NVFP4_CONFIG, ct_nvfp4_tensors, linear_modules

    sd = dense_state_dict()
    path = write_dir(str(tmp_path / "nvfp4"), ct_nvfp4_tensors(sd, linear_modules()), TINY,
                     quantization_config=dict(CT_NVFP4_CONFIG, ignore=["lm_head"]))
    loaded = load_model(ModelConfig(model=path, device="cpu", dtype="float32", ignore=("down_proj",)), progress=False)
    mlp = loaded.model.get_submodule("model.layers.1.mlp")
    assert isinstance(mlp.down_proj, DenseLinear) and isinstance(mlp.gate_up_proj, Mxfp4Linear)
    stored = dict(open_checkpoint(path).iter_weights(progress=False))["model.layers.1.mlp.down_proj"]
    assert torch.equal(mlp.down_proj.weight, dequantize(stored).float())
    layers = TINY["num_hidden_layers"]
    assert f"{layers} nvfp4-dequant" in "\n".join(loaded.summary)
