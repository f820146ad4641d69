"""convert -> read round trips for every format, requantization of NVFP4 checkpoints, the report."""

import json
import os

import pytest
import torch

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.checkpoint.report import RequantReport
from radiance.config import ConvertConfig
from radiance.formats import (DenseWeight, Fp8Weight, Mxfp4Weight, Nvfp4Weight, dequantize, nvfp4_to_mxfp4,
                              quantize_mxfp4)
from tests.checkpoint.factory import CHAT_TEMPLATE, TINY, dense_state_dict, write_dir

P0 = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_dir(str(tmp_path_factory.mktemp("src")), dense_state_dict(), TINY, tokenizer=True)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("fmt,cls,bound", [("mxfp4", Mxfp4Weight, 0.2), ("nvfp4", Nvfp4Weight, 0.15),
                                           ("fp8", Fp8Weight, 0.05)])
def test_write_read_round_trip(source, tmp_path, fmt, cls, bound):
    sd = dense_state_dict()
    report = convert_checkpoint(source, str(tmp_path / fmt), ConvertConfig(format=fmt), progress=False)
    assert len(report.entries) == 4 * TINY["num_hidden_layers"]
    ckpt = open_checkpoint(str(tmp_path / fmt))
    assert ckpt.warnings == [] and ckpt.quant.formats() == [fmt]
    got = ckpt.state_dict()
    q, k, v = (sd[f"{P0}.{x}_proj.weight"].float() for x in "qkv")
    qkv = got[f"{P0}.qkv_proj"]
    assert isinstance(qkv, cls) and qkv.partition_sizes == (64, 32, 32)
    assert _rel(dequantize(qkv), torch.cat([q, k, v])) < bound
    if fmt == "mxfp4":  # exactly the codec's bytes (rule mse)
        packed, scale = quantize_mxfp4(torch.cat([q, k, v]), "mse")
        assert torch.equal(qkv.packed, packed) and torch.equal(qkv.scale, scale)
    if fmt == "nvfp4":  # one global scale per projection, 448 * 6 / amax (the divisor convention)
        expected = torch.tensor([2688.0 / float(t.abs().max()) for t in (q, k, v)])
        torch.testing.assert_close(qkv.global_scale, expected, rtol=1e-6, atol=0)
    if fmt == "fp8":
        torch.testing.assert_close(qkv.scale[:64, 0], q.abs().amax(1) / 448.0, rtol=1e-6, atol=0)
    # lm_head and embeddings stay 16-bit, norms are copied, the head is listed as ignored
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"])
    assert torch.equal(got["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    with open(tmp_path / fmt / "config.json") as handle:
        qc = json.load(handle)["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    # tokenizer files travel with the weights
    assert ckpt.chat_template == CHAT_TEMPLATE and ckpt.tokenizer().encode("w9", add_special_tokens=False) == [9]


def test_written_quantization_config_follows_the_compressed_tensors_schema(source, tmp_path):
    """Field names and values of compressed-tensors' pydantic models (QuantizationArgs/Scheme forbid extras)."""
    args_keys = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                 "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs"}
    expected = {"mxfp4": ("mxfp4-pack-quantized", 4, 32, "group", "torch.uint8"),
                "nvfp4": ("nvfp4-pack-quantized", 4, 16, "tensor_group", "torch.float8_e4m3fn"),
                "fp8": ("float-quantized", 8, None, "channel", None)}
    from radiance.checkpoint.writer import quantization_config_for
    for fmt, (storage, bits, group, strategy, scale_dtype) in expected.items():
        qc = quantization_config_for(fmt, ["lm_head"])
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == storage
        assert qc["quantization_status"] == "compressed"
        scheme = qc["config_groups"]["group_0"]
        assert set(scheme) <= {"targets", "weights", "input_activations", "output_activations", "format"}
        w = scheme["weights"]
        assert set(w) <= args_keys and (w["num_bits"], w["type"], w["group_size"], w["strategy"]) == \
            (bits, "float", group, strategy)
        assert w.get("scale_dtype") == scale_dtype and w["symmetric"] is True and w["dynamic"] is False
        if scheme["input_activations"]:
            assert set(scheme["input_activations"]) <= args_keys


def test_nvfp4_checkpoint_requantized_to_mxfp4_per_partition(source, tmp_path):
    convert_checkpoint(source, str(tmp_path / "nv"), ConvertConfig(format="nvfp4"), progress=False)
    nv = open_checkpoint(str(tmp_path / "nv")).state_dict()[f"{P0}.qkv_proj"]
    report = convert_checkpoint(str(tmp_path / "nv"), str(tmp_path / "mx"),
                                ConvertConfig(format="mxfp4", rule="noclip"), progress=False)
    mx = open_checkpoint(str(tmp_path / "mx")).state_dict()[f"{P0}.qkv_proj"]
    packed, scale, err = nvfp4_to_mxfp4(nv.packed, nv.scale, nv.global_scale, nv.partition_sizes, "noclip")
    assert torch.equal(mx.packed, packed) and torch.equal(mx.scale, scale)
    entry = next(e for e in report.entries if e.name == f"{P0}.qkv_proj")
    assert entry.source_format == "nvfp4" and entry.rel_rms == pytest.approx(err)
    assert entry.rel_rms == pytest.approx(_rel(dequantize(mx), dequantize(nv)), rel=1e-5)
    summary = report.summary()
    assert "converted 8 linears nvfp4 -> mxfp4, rule noclip" in summary and "qkv_proj 2" in summary
    assert f"worst {report.worst.rel_rms:.4f}" in summary and max(e.rel_rms for e in report.entries) == report.worst.rel_rms


def test_same_format_is_not_requantized(source, tmp_path):
    convert_checkpoint(source, str(tmp_path / "a"), ConvertConfig(format="mxfp4"), progress=False)
    report = convert_checkpoint(str(tmp_path / "a"), str(tmp_path / "b"), ConvertConfig(format="mxfp4"),
                                progress=False)
    assert report.entries == [] and report.kept["mxfp4"] == 8
    with open(tmp_path / "a" / "model.safetensors", "rb") as a, open(tmp_path / "b" / "model.safetensors", "rb") as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("fmt,cls", [("fp8", Fp8Weight), ("nvfp4", Nvfp4Weight)])
def test_mxfp4_to_fp8_or_nvfp4_keeps_the_mxfp4_values_exactly(source, tmp_path, fmt, cls):
    """MXFP4's values (e2m1 codes times power-of-two block scales) fit e4m3 under a power-of-two row scale, and
    NVFP4 under power-of-two block and global scales: the converted checkpoint holds them exactly (relRMS 0; amax
    scales gave ~3% and ~6%), and converting back gives the MXFP4 bytes."""
    convert_checkpoint(source, str(tmp_path / "mx"), ConvertConfig(format="mxfp4"), progress=False)
    report = convert_checkpoint(str(tmp_path / "mx"), str(tmp_path / fmt), ConvertConfig(format=fmt),
                                progress=False)
    assert len(report.entries) == 8 and all(entry.rel_rms == 0.0 for entry in report.entries)
    mx, converted = (open_checkpoint(str(tmp_path / d)).state_dict() for d in ("mx", fmt))
    qkv = converted[f"{P0}.qkv_proj"]
    assert isinstance(qkv, cls) and torch.equal(dequantize(qkv), dequantize(mx[f"{P0}.qkv_proj"]))
    scales = torch.cat([qkv.scale.float().flatten(), getattr(qkv, "global_scale", torch.ones(1)).flatten()])
    scales = scales[scales > 0]
    assert torch.equal(torch.frexp(scales).mantissa, torch.full_like(scales, 0.5))  # powers of two
    convert_checkpoint(str(tmp_path / fmt), str(tmp_path / "back"), ConvertConfig(format="mxfp4"), progress=False)
    back = open_checkpoint(str(tmp_path / "back")).state_dict()[f"{P0}.qkv_proj"]
    assert torch.equal(back.packed, mx[f"{P0}.qkv_proj"].packed) and torch.equal(back.scale, mx[f"{P0}.qkv_proj"].scale)


def test_ignore_regex_lm_head_and_shards(source, tmp_path):
    config = ConvertConfig(format="mxfp4", ignore=(r"layers\.1\.mlp",), quantize_lm_head=True, max_shard_bytes=20000)
    convert_checkpoint(source, str(tmp_path / "out"), config, progress=False)
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    ckpt = open_checkpoint(str(tmp_path / "out"))
    got = ckpt.state_dict()
    assert isinstance(got["lm_head"], Mxfp4Weight) and "lm_head.weight" not in got
    assert isinstance(got["model.layers.1.mlp.down_proj"], DenseWeight)
    assert isinstance(got["model.layers.0.mlp.down_proj"], Mxfp4Weight)
    qc = ckpt.config["quantization_config"]
    assert sorted(qc["ignore"]) == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
                                    "model.layers.1.mlp.up_proj"]
    assert ckpt.warnings == []


def test_tied_head_quantized_on_request(tmp_path):
    config = dict(TINY, tie_word_embeddings=True)
    src = write_dir(str(tmp_path / "src"), dense_state_dict(config), config)
    convert_checkpoint(src, str(tmp_path / "out"), ConvertConfig(format="nvfp4", quantize_lm_head=True),
                       progress=False)
    ckpt = open_checkpoint(str(tmp_path / "out"))
    assert ckpt.config["tie_word_embeddings"] is False
    head = ckpt.state_dict()["lm_head"]
    assert isinstance(head, Nvfp4Weight)
    assert _rel(dequantize(head), dense_state_dict(config)["model.embed_tokens.weight"]) < 0.15


def test_destination_must_be_new(source, tmp_path):
    from radiance.errors import CheckpointError

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        convert_checkpoint(source, str(tmp_path / "busy"), ConvertConfig(), progress=False)


def test_report_lines(caplog):
    import logging

    report = RequantReport("mxfp4", "mse")
    with caplog.at_level(logging.DEBUG, logger="radiance.checkpoint.report"):
        report.add("model.layers.0.self_attn.qkv_proj", "nvfp4", 0.15)
        report.add("model.layers.0.mlp.down_proj", "nvfp4", 0.2)
        report.add("model.layers.1.mlp.down_proj", "nvfp4", 0.1)
        report.keep("lm_head", "dense")
        line = report.summary()
    assert line.startswith("converted 3 linears nvfp4 -> mxfp4, rule mse (qkv_proj 1, down_proj 2); kept 1 dense")
    assert "mean 0.1500, worst 0.2000 (model.layers.0.mlp.down_proj)" in line
    assert any("qkv_proj: nvfp4 -> mxfp4 relRMS 0.1500" in r.message for r in caplog.records)


def test_cli_convert_and_inspect(source, tmp_path, capsys, caplog):
    import logging

    from radiance.cli import main

    caplog.set_level(logging.INFO)

    dst = str(tmp_path / "fp8")
    assert main(["convert", source, dst, "--format", "fp8", "--ignore", r"layers\.1\.", "--no-progress"]) == 0
    out = capsys.readouterr().out
    summary = "converted 4 linears dense -> fp8 (down_proj 1, gate_up_proj 1, o_proj 1, qkv_proj 1); kept 4 dense"
    assert out.startswith(summary) and len(out.splitlines()) == 1
    # once: the summary was also an INFO line, and "wrote DST" printed beside the log's own "wrote DST (files, MiB)"
    assert not any("converted 4" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith(f"wrote {dst} (") for r in caplog.records)
    assert main(["inspect", dst]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(l.split()[:4] == ["qkv_proj", "1", "fp8", "[128,"] for l in lines)
    assert any(l.split()[:3] == ["qkv_proj", "1", "dense"] for l in lines)
    assert lines[-1].startswith("warnings   none")
    assert main(["convert", source, str(tmp_path / "x"), "--format", "int4"]) == 2
    assert "format must be one of" in capsys.readouterr().err
