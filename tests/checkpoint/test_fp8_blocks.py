"""Block-scaled FP8 checkpoints: transformers' `fp8` quant_method (Qwen3-*-FP8, DeepSeek-style: e4m3 `weight` and a
`weight_scale_inv` per weight_block_size block, modules_to_not_convert) and compressed-tensors' strategy block. Were
refused ("unsupported quantization_config.quant_method 'fp8'"). Written here by hand, independently of radiance."""

from __future__ import annotations

import math

import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.cli import main
from radiance.config import ModelConfig
from radiance.engine.loader import load_model
from radiance.errors import CheckpointError
from radiance.formats import Fp8Weight, dequantize
from tests.checkpoint.factory import TINY, dense_state_dict, linear_modules, write_dir

BLOCK = (32, 64)  # rows x K; K = 96 (down_proj) ends in a short block


def fp8_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scales [ceil(N/bn), ceil(K/bk)]) with w ~= codes * scale of the block, by plain loops."""
    n, k = w.shape
    bn, bk = block
    scales = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    codes = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scales[i, j] = tile.abs().max() / 448.0
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = tile / scales[i, j]
    return codes.to(torch.float8_e4m3fn), scales


def block_dequantized(codes: torch.Tensor, scales: torch.Tensor, block=BLOCK) -> torch.Tensor:
    bn, bk = block
    out = codes.float().clone()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scales[i, j]
    return out


def hf_fp8_checkpoint(path, scale_leaf="weight_scale_inv", ignore=("model.layers.1.mlp.down_proj",)):
    """(directory, the same model with the dequantized weights as 16-bit tensors)."""
    tensors = dense_state_dict(dtype=torch.float32)
    dense = dict(tensors)
    for module in linear_modules():
        if module in ignore:
            continue
        codes, scales = fp8_blocks(tensors.pop(f"{module}.weight"))
        tensors[f"{module}.weight"], tensors[f"{module}.{scale_leaf}"] = codes, scales
        dense[f"{module}.weight"] = block_dequantized(codes, scales)
    if scale_leaf == "weight_scale_inv":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK),
              "modules_to_not_convert": list(ignore)}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignore),
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                  "block_structure": list(BLOCK)}}}}
    return write_dir(str(path / "fp8"), tensors, TINY, qc), write_dir(str(path / "dense"), dense, TINY)


@pytest.mark.parametrize("scale_leaf", ["weight_scale_inv", "weight_scale"], ids=["transformers", "compressed-tensors"])
def test_block_fp8_serves_its_dequantized_values(tmp_path, scale_leaf):
    fp8_dir, dense_dir = hf_fp8_checkpoint(tmp_path, scale_leaf)
    ckpt = open_checkpoint(fp8_dir)
    qkv = dict(ckpt.iter_weights(progress=False))["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Fp8Weight) and qkv.block_k == BLOCK[1] and qkv.partition_sizes == (64, 32, 32)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    config = ModelConfig(device="cpu", dtype="float32", quantization="none")
    ours = load_model(config, checkpoint=ckpt, progress=False).model.forward_logits(ids)
    ref = load_model(config, checkpoint=open_checkpoint(dense_dir), progress=False).model.forward_logits(ids)
    assert torch.allclose(ours, ref, rtol=0, atol=1e-5)
    # requantized to MXFP4 at load as any FP8 checkpoint: the same codes as from the dequantized 16-bit values
    mx = ModelConfig(device="cpu", dtype="float32", quantization="mxfp4")
    mx_fp8 = load_model(mx, checkpoint=open_checkpoint(fp8_dir), progress=False).model.forward_logits(ids)
    mx_dense = load_model(mx, checkpoint=open_checkpoint(dense_dir), progress=False).model.forward_logits(ids)
    assert torch.allclose(mx_fp8, mx_dense, rtol=0, atol=1e-5)


def test_the_reader_expands_each_block_s_scale_over_its_rows_and_k(tmp_path):
    fp8_dir, _ = hf_fp8_checkpoint(tmp_path)
    weights = dict(open_checkpoint(fp8_dir).iter_weights(progress=False))
    down = weights["model.layers.0.mlp.down_proj"]  # [64, 96]: K in blocks of 64 and 32
    assert down.scale.shape == (64, 2)
    from safetensors.torch import load_file
    stored = load_file(f"{fp8_dir}/model.safetensors")
    prefix = "model.layers.0.mlp.down_proj"
    assert torch.equal(dequantize(down), block_dequantized(stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale_inv"]))
    assert weights["model.layers.1.mlp.down_proj"].format == "dense"  # modules_to_not_convert


def test_inspect_and_convert(tmp_path, capsys):
    fp8_dir, _ = hf_fp8_checkpoint(tmp_path)
    assert main(["inspect", fp8_dir, "--values"]) == 0
    out = capsys.readouterr().out
    assert "fp8 (blocks of 32 x 64)" in out and "servable   yes" in out and "all finite" in out
    assert "lm_head" not in out.split("warnings")[-1]  # transformers' fp8 never converts the head: no warning
    for fmt in ("mxfp4", "fp8"):  # fp8 is written per channel: requantized from the blocks
        assert main(["convert", fp8_dir, str(tmp_path / f"to-{fmt}"), "--format", fmt, "--no-progress"]) == 0
        converted = dict(open_checkpoint(str(tmp_path / f"to-{fmt}")).iter_weights(progress=False))
        assert converted["model.layers.0.mlp.down_proj"].format == fmt
    assert converted["model.layers.0.mlp.down_proj"].block_k == 0


@pytest.mark.parametrize("block", [None, [128], [0, 128], "128"])
def test_a_bad_block_size_is_named(tmp_path, block):
    qc = {"quant_method": "fp8", "weight_block_size": block}
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, qc)
    with pytest.raises(CheckpointError, match="weight_block_size must be two positive integers"):
        open_checkpoint(path)


def test_scales_that_do_not_tile_the_weight_are_named(tmp_path):
    fp8_dir, _ = hf_fp8_checkpoint(tmp_path)
    from safetensors.torch import load_file, save_file
    tensors = load_file(f"{fp8_dir}/model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = torch.ones(3, 1)  # 64 rows in 3 blocks: no block size gives that
    save_file(tensors, f"{fp8_dir}/model.safetensors")
    with pytest.raises(CheckpointError) as err:
        dict(open_checkpoint(fp8_dir).iter_weights(progress=False))
    assert "fp8 block scales" in str(err.value) and name in str(err.value)


def test_a_mixture_of_experts_checkpoint_in_fp8_blocks(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: every expert's projections e4m3 with their own block scales, the router 16-bit."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.engine.conftest import tiny_hf_model

    tiny_hf_model("qwen3moe").save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    dense, fp8 = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):  # attention and experts; mlp.gate (the router) stays 16-bit
            codes, scales = fp8_blocks(w, (32, 32))
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = codes, scales
            dense[name] = block_dequantized(codes, scales, (32, 32))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    qc = {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "dynamic",
          "modules_to_not_convert": ["re:.*mlp\\.gate$"]}
    paths = {}
    for kind, state, quant in (("dense", dense, None), ("fp8", fp8, qc)):
        paths[kind] = write_dir(str(tmp_path / kind), state, config, quant)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
    for quantization in ("none", "mxfp4"):
        config = ModelConfig(device="cpu", dtype="float32", quantization=quantization)
        logits = [load_model(config, checkpoint=open_checkpoint(paths[kind]), progress=False).model.forward_logits(ids)
                  for kind in ("fp8", "dense")]
        assert torch.allclose(*logits, rtol=0, atol=1e-5), quantization
