"""float16 / float32 checkpoints through inspect, convert and load."""

import os

import pytest
import torch
from safetensors import safe_open

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.config import ConvertConfig, ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir

NORM = "model.layers.0.post_attention_layernorm.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


def _written(path: str) -> dict[str, torch.dtype]:
    with safe_open(f"{path}/model.safetensors", "pt") as handle:
        return {name: handle.get_slice(name).get_dtype() for name in handle.keys()}


@pytest.mark.parametrize("dtype,written", [(torch.float16, "F16"), (torch.float32, "BF16")])
def test_16_and_32_bit_checkpoints_convert_and_load(tmp_path, dtype, written):
    """16-bit tensors are written as they are, float32 ones in --dense-dtype (bfloat16 by default)."""
    src = write_dir(str(tmp_path / "src"), dense_state_dict(dtype=dtype), TINY)
    assert {e.format for e in open_checkpoint(src).describe() if not e.is_linear} == {str(dtype)[6:]}
    out = str(tmp_path / "out")
    convert_checkpoint(src, out, ConvertConfig(format="mxfp4"), progress=False)
    assert _written(out)["model.embed_tokens.weight"] == written
    for path in (src, out):
        model = load_model(ModelConfig(model=path, device="cpu", dtype="float32"), progress=False).model
        assert torch.isfinite(model.forward_logits(torch.tensor([[3, 4, 5]]))).all()


@pytest.mark.parametrize("name,ignore", [(NORM, ()), (DOWN, ("down_proj",))], ids=["norm", "kept-linear"])
def test_a_float32_value_beyond_float16_is_named_not_written_as_inf(tmp_path, name, ignore):
    """`convert --dense-dtype float16` of a float32 checkpoint wrote inf for values above 65504 without a word,
    and the converted model answered NaN."""
    tensors = dense_state_dict(dtype=torch.float32)
    tensors[name][(0,) * tensors[name].dim()] = 1e5
    src = write_dir(str(tmp_path / "src"), tensors, TINY)
    config = ConvertConfig(format="mxfp4", dense_dtype="float16", ignore=ignore)
    with pytest.raises(CheckpointError, match="magnitude 100000 overflows float16") as info:
        convert_checkpoint(src, str(tmp_path / "out"), config, progress=False)
    assert info.value.tensor == name and info.value.file == os.path.join(src, "model.safetensors")
    assert not (tmp_path / "out").exists()
    convert_checkpoint(src, str(tmp_path / "bf16"), ConvertConfig(format="mxfp4", ignore=ignore), progress=False)
