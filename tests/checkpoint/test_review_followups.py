"""Review follow-ups on checkpoints: compressed-tensors' preset config groups ({"FP8_DYNAMIC": ["Linear"]}) say how
their FP8 scales go, as the written-out groups do; a Hub GGUF repo whose quantizations are all split is told as such.
Checkpoints are written by hand (tests/checkpoint/factory.py), the Hub is faked as test_hub_errors.py fakes it."""

from __future__ import annotations

import os
import re

import pytest

from radiance.checkpoint import open_checkpoint
from radiance.errors import CheckpointError
from tests.checkpoint import corruptions as c
from tests.checkpoint import factory as f
from tests.checkpoint.test_checkpoint_fuzz import MODULES, _refusal, answer
from tests.checkpoint.test_hub_errors import cache, online  # noqa: F401 - the faked Hub's fixtures

SQUARE_SCALE = "model.layers.1.self_attn.o_proj.weight_scale"  # o_proj is [64, 64]: a [1, 64] scale fits blocks too


def _ct_fp8(path, qc: dict, tensors: dict, transposed: str | None = None) -> str:
    f.write_dir(str(path), tensors, f.TINY, qc)
    if transposed is not None:
        c.rewrite(os.path.join(path, "model.safetensors"),
                  lambda t: t.__setitem__(transposed, t[transposed].t().contiguous()))
    return str(path)


def _preset(name: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {name: ["Linear"]}}


def _ct_block(block=(128, 128)) -> dict:
    qc = f.ct_fp8_config("block")
    qc["config_groups"]["group_0"]["weights"]["block_structure"] = list(block)
    return qc


def _block_tensors(block) -> dict:
    """Block FP8 under compressed-tensors' name for the scales (`weight_scale`, not transformers' `_inv`)."""
    tensors = f.fp8_block_tensors(f.dense_state_dict(), MODULES, block)
    return {k.removesuffix("_inv"): v for k, v in tensors.items()}


@pytest.mark.parametrize("preset, strategy, per_tensor", [("FP8_DYNAMIC", "channel", False),
                                                          ("FP8", "tensor", True)])
def test_an_fp8_preset_group_answers_as_its_written_out_group(tmp_path, preset, strategy, per_tensor):
    tensors = f.fp8_tensors(f.dense_state_dict(), MODULES, per_tensor=per_tensor)
    written = answer(_ct_fp8(tmp_path / "written", f.ct_fp8_config(strategy), tensors))
    assert answer(_ct_fp8(tmp_path / "preset", _preset(preset), tensors)) == written


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "fp8_dynamic", "FP8"])
def test_a_transposed_per_channel_scale_under_an_fp8_preset_group_is_refused(tmp_path, preset):
    """The preset form left the scales' orientation unsaid: the [1, 64] scale of the square o_proj was read as 64
    blocks of 64 x 1 and the model answered differently, without a word. The FP8 presets are per channel (FP8_DYNAMIC)
    or per tensor (FP8): one scale per row, as the written-out strategy "channel" group says."""
    path = _ct_fp8(tmp_path / "m", _preset(preset), f.fp8_tensors(f.dense_state_dict(), MODULES), SQUARE_SCALE)
    message = _refusal(path)
    assert "wrong shape [1, 64] for fp8 weight scales" in message
    assert message.endswith(f"(file {os.path.join(path, 'model.safetensors')}, tensor {SQUARE_SCALE})")


def test_the_fp8_block_preset_reads_its_128_x_128_blocks(tmp_path):
    """FP8_BLOCK (compressed-tensors' preset of 128 x 128 weight blocks) was refused as an unknown preset; read, its
    block is the preset's, so scales of other blocks are refused rather than read by their shape."""
    tensors = _block_tensors((128, 128))
    written = answer(_ct_fp8(tmp_path / "written", _ct_block((128, 128)), tensors))
    assert answer(_ct_fp8(tmp_path / "preset", _preset("FP8_BLOCK"), tensors)) == written
    path = _ct_fp8(tmp_path / "small-blocks", _preset("FP8_BLOCK"), _block_tensors((32, 64)))
    message = _refusal(path)  # [2, 1] (q, o), [1, 1] (k, v), [2, 2] (down), [3, 1] (gate, up): one is refused
    assert re.search(r"wrong shape \[\d, \d\] for fp8 block scales \(128 x 128 blocks\), expected \[1, 1\] \(file "
                     + re.escape(os.path.join(path, "model.safetensors")) + r", tensor model\.layers\.\d\.\w+\.\w+"
                     r"\.weight_scale\)$", message), message


def test_an_unknown_preset_names_the_ones_read(tmp_path):
    path = f.write_dir(str(tmp_path / "m"), f.dense_state_dict(), f.TINY, _preset("W4A16"))
    with pytest.raises(CheckpointError, match=r"unsupported compressed-tensors preset scheme 'W4A16'; radiance reads "
                                              r"NVFP4, .*FP8_DYNAMIC, FP8_BLOCK"):
        open_checkpoint(path)


# ---------------------------------------------------------------------- Hub GGUF repos of split models

SPLIT_QUANTS = ["README.md", "Q4_K_M/Big-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/Big-Q4_K_M-00002-of-00002.gguf",
                "Q8_0/Big-Q8_0-00001-of-00003.gguf", "Q8_0/Big-Q8_0-00002-of-00003.gguf",
                "Q8_0/Big-Q8_0-00003-of-00003.gguf"]


def test_a_repo_of_several_split_models_says_all_are_split_and_names_them(online):
    """Said "its one GGUF model is a split GGUF" of a repo holding two quantizations, each in parts."""
    online.listing = SPLIT_QUANTS
    with pytest.raises(CheckpointError) as err:
        open_checkpoint("org/Big-GGUF")
    assert str(err.value) == ("org/Big-GGUF: all 2 of its GGUF models are split GGUFs (Big-Q4_K_M, Big-Q8_0), which "
                              "radiance does not read (pick one and merge the parts with llama.cpp's "
                              "llama-gguf-split --merge)")


def test_a_tag_naming_several_split_models_counts_models_and_one_names_its_parts(online):
    online.listing = [*SPLIT_QUANTS, "Q4_0/Big-Q4_0-00001-of-00002.gguf", "Q4_0/Big-Q4_0-00002-of-00002.gguf"]
    with pytest.raises(CheckpointError, match=r"^org/Big-GGUF:Q4: the 2 GGUF models 'Q4' names are split GGUFs "
                                              r"\(Big-Q4_0, Big-Q4_K_M\)"):
        open_checkpoint("org/Big-GGUF:Q4")
    with pytest.raises(CheckpointError, match=r"^org/Big-GGUF:Q8_0: 'Q8_0' names a split GGUF"):
        open_checkpoint("org/Big-GGUF:Q8_0")


def test_one_split_model_is_still_its_one_model_and_an_unsplit_one_asks_for_a_tag(online):
    online.listing = SPLIT_QUANTS[:3]
    with pytest.raises(CheckpointError, match=r"^org/Big-GGUF: its one GGUF model is a split GGUF"):
        open_checkpoint("org/Big-GGUF")
    online.listing = [*SPLIT_QUANTS, "Big-Q2_K.gguf"]  # one is readable: choose it by its tag
    with pytest.raises(CheckpointError, match=r"^org/Big-GGUF holds several GGUF files: name one as "
                                              r"org/Big-GGUF:TAG"):
        open_checkpoint("org/Big-GGUF")
