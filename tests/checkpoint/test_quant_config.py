"""quantization_config parsing: formats per module, targets, ignore/exclude lists."""

import copy
import logging

import pytest

from radiance.checkpoint.quant_config import module_form, parse_quantization_config
from radiance.errors import CheckpointError
from tests.checkpoint.factory import CT_NVFP4_CONFIG

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.3.mlp.down_proj"


def test_none_is_dense():
    spec = parse_quantization_config(None)
    assert spec.method == "none" and spec.scheme_for(Q).format == "dense"


def test_compressed_tensors_linear_target_and_ignore():
    spec = parse_quantization_config(CT_NVFP4_CONFIG)
    assert spec.scheme_for(Q).format == "nvfp4"
    assert spec.scheme_for("lm_head").format == "dense"  # ignored
    assert spec.scheme_for("model.embed_tokens").format == "dense"  # not a Linear


@pytest.mark.parametrize("weights,fmt", [
    ({"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group"}, "mxfp4"),
    ({"num_bits": 8, "type": "float", "strategy": "channel"}, "fp8"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor"}, "fp8"),
])
def test_compressed_tensors_formats(weights, fmt):
    qc = copy.deepcopy(CT_NVFP4_CONFIG)
    qc["format"] = {"mxfp4": "mxfp4-pack-quantized", "fp8": "float-quantized"}[fmt]
    qc["config_groups"]["group_0"]["weights"] = weights
    assert parse_quantization_config(qc).scheme_for(DOWN).format == fmt


def test_regex_and_exact_targets_win_over_class():
    qc = copy.deepcopy(CT_NVFP4_CONFIG)
    qc["format"] = "mixed-precision"
    qc["config_groups"]["group_1"] = {
        "targets": ["re:.*mlp\\.down_proj$"], "format": "float-quantized",
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    spec = parse_quantization_config(qc)
    assert spec.scheme_for(DOWN).format == "fp8"
    assert spec.scheme_for(Q).format == "nvfp4"


def test_preset_group():
    qc = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
          "config_groups": {"MXFP4A16": ["Linear"]}, "ignore": []}
    assert parse_quantization_config(qc).scheme_for(Q).format == "mxfp4"


@pytest.mark.parametrize("entry,meant", [
    ("mtp.fc.weight", "mtp.fc"), ("model.layers.1.mlp.down_proj.weight_packed", "model.layers.1.mlp.down_proj"),
    ("re:.*mlp\\.down_proj\\.weight$", "re:.*mlp\\.down_proj$"), ("lm_head", None), ("re:.*gate$", None),
])
def test_module_form(entry, meant):
    assert module_form(entry) == meant


def test_tensor_named_ignore_warns_and_matches_as_meant(caplog):
    qc = copy.deepcopy(CT_NVFP4_CONFIG)
    qc["ignore"] = ["lm_head", f"{DOWN}.weight"]
    with caplog.at_level(logging.WARNING):
        spec = parse_quantization_config(qc)
    assert spec.scheme_for(DOWN).format == "dense"
    assert spec.scheme_for(DOWN.replace("3", "4")).format == "nvfp4"
    assert any(f"{DOWN}.weight" in w and f"write '{DOWN}'" in w for w in spec.warnings)
    assert any("names a tensor" in r.message for r in caplog.records)


def test_ignore_entry_matching_nothing_is_reported():
    spec = parse_quantization_config(CT_NVFP4_CONFIG)
    spec.check_modules([Q, DOWN])
    assert any("'lm_head' matches no module" in w for w in spec.warnings)


def test_quark_mxfp4_with_glob_exclude():
    qc = {"quant_method": "quark", "export": {"pack_method": "reorder", "kv_cache_group": []},
          "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32,
                                             "scale_format": "e8m0", "is_dynamic": False},
                                  "input_tensors": None, "output_tensors": None, "bias": None},
          "layer_quant_config": {}, "layer_type_quant_config": {},
          "exclude": ["lm_head", "*layers.1.mlp.down_proj"]}
    spec = parse_quantization_config(qc)
    assert spec.scheme_for(Q).format == "mxfp4" and spec.scheme_for(Q).layout == "quark"
    assert spec.scheme_for("model.layers.1.mlp.down_proj").format == "dense"
    assert spec.scheme_for("lm_head").format == "dense"


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization_config.quant_method 'gptq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, "num_bits=4, type=int"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "no config_groups"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}, "storage format"),
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int4", "qscheme": "per_group"}}},
     "unsupported Quark weight scheme"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "unsupported ModelOpt quant_algo 'W4A8_AWQ'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    # were "has no config_groups" / "has no targets": both given, of the wrong type
    ({"quant_method": "compressed-tensors", "config_groups": [1]},
     "config_groups must be an object of named groups, got list"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
        "targets": "Linear", "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
     "config group 'group_0': targets must be a list of module names or patterns, got str"),
])
def test_unsupported_configs_name_the_problem(qc, needle):
    with pytest.raises(CheckpointError, match="config.json") as info:
        parse_quantization_config(qc, source="config.json")
    assert needle in str(info.value)


def test_modelopt_nvfp4_with_glob_excludes():
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
          "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.0.self_attn*"]}
    spec = parse_quantization_config(qc)
    assert spec.scheme_for("model.layers.1.self_attn.q_proj").format == "nvfp4"
    assert spec.scheme_for("model.layers.1.self_attn.q_proj").layout == "modelopt"
    assert spec.scheme_for("model.layers.3.mlp.experts.7.down_proj").format == "nvfp4"
    for excluded in ("lm_head", "model.layers.2.mlp.gate", "model.layers.0.self_attn.o_proj"):
        assert spec.scheme_for(excluded, linear=True).format == "dense", excluded
    assert parse_quantization_config({"quant_method": "modelopt", "quant_algo": "FP8"}).formats() == ["fp8"]


def test_w4a4_input_activations_are_a_warning_not_silence():
    """An NVFP4 group calibrated for 4-bit activations (llm-compressor's NVFP4 scheme) is served W4A8: said once,
    naming the group and the file; weight-only groups stay quiet."""
    qc = copy.deepcopy(CT_NVFP4_CONFIG)
    assert parse_quantization_config(qc, "config.json").warnings == []
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4, "type": "float", "group_size": 16,
                                                          "strategy": "tensor_group", "dynamic": "local"}
    warnings = parse_quantization_config(qc, "config.json").warnings
    assert warnings == ["config group 'group_0' declares 4-bit input activations (W4A4, config.json): radiance "
                        "serves its weights with fp8 activations per token (W4A8), more exact than its calibration "
                        "assumed"]
