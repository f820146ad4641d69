"""Seeded fuzz / churn over broken checkpoints of every on-disk format radiance reads.

Each case copies a tiny checkpoint (a 1-2 layer Llama-like model: bf16 / fp16 / fp32, FP8 per-tensor, per-channel and
block-scaled, MXFP4 of compressed-tensors, Quark and gpt-oss, NVFP4 of compressed-tensors and ModelOpt, sharded with
an index, GGUF), breaks it one way, and loads it as the server does (`LLM`). The product rule: a broken checkpoint
names the file and tensor at fault. So the load either refuses with radiance's own error naming the file at fault
(and the tensor, where one is), or it accepts and answers exactly as the intact model does; and `radiance inspect
--strict --values` reports rather than crashes. Cases are drawn from fixed seeds, so every run fuzzes the same ones.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from radiance.cli import main
from radiance.engine.llm import LLM
from radiance.engine.sampling_params import SamplingParams
from radiance.errors import RadianceError
from tests.checkpoint import factory as f
from tests.checkpoint import corruptions as c
from tests.checkpoint.corruptions import GGUF_TYPES, Fault, Safetensors

MODULES = f.linear_modules()
PROMPT = [5, 6, 7, 8]
CASES_PER_KIND = 3  # byte-level kinds, spread over the formats


# ---------------------------------------------------------------------- the intact checkpoints

def _gguf(path: str) -> str:
    from tests.checkpoint.test_gguf_metadata import write_gguf

    return write_gguf(os.path.join(path, "model.gguf"), types=GGUF_TYPES)


def _hf(tensors, config=f.TINY, qc=None, tokenizer=False):
    return lambda path: f.write_dir(path, tensors(), config, qc, tokenizer=tokenizer)


BASES = {
    "bf16": _hf(f.dense_state_dict, tokenizer=True),
    "fp16": _hf(lambda: f.dense_state_dict(dtype=torch.float16), dict(f.TINY, torch_dtype="float16")),
    "fp32": _hf(lambda: f.dense_state_dict(dtype=torch.float32), dict(f.TINY, torch_dtype="float32")),
    "fp8-tensor": _hf(lambda: f.fp8_tensors(f.dense_state_dict(), MODULES, per_tensor=True),
                      qc=f.ct_fp8_config("tensor")),
    "fp8-channel": _hf(lambda: f.fp8_tensors(f.dense_state_dict(), MODULES), qc=f.ct_fp8_config()),
    "fp8-block": _hf(lambda: f.fp8_block_tensors(f.dense_state_dict(), MODULES), qc=f.HF_FP8_CONFIG),
    "mxfp4-ct": _hf(lambda: f.ct_mxfp4_tensors(f.dense_state_dict(), MODULES), qc=f.CT_MXFP4_CONFIG),
    "mxfp4-quark": _hf(lambda: f.ct_mxfp4_tensors(f.dense_state_dict(), MODULES, "weight"), qc=f.QUARK_MXFP4_CONFIG),
    "mxfp4-gptoss": _hf(f.gpt_oss_tensors, f.GPT_OSS),
    "nvfp4-ct": _hf(lambda: f.ct_nvfp4_tensors(f.dense_state_dict(), MODULES), qc=f.CT_NVFP4_CONFIG),
    "nvfp4-modelopt": _hf(lambda: f.modelopt_nvfp4_tensors(f.dense_state_dict(), MODULES), qc=f.MODELOPT_NVFP4_CONFIG),
    "sharded": lambda path: f.write_sharded(path, f.dense_state_dict(), f.TINY),
    "gguf": _gguf,
}
SAFETENSORS_BASES = [b for b in BASES if b != "gguf"]
QUANTIZED_BASES = [b for b in SAFETENSORS_BASES if b.startswith(("fp8", "mxfp4", "nvfp4"))]


def answer(path: str):
    """What the model answers greedily to PROMPT (token ids and logprobs), loaded as the server loads it."""
    llm = LLM(model=path, device="cpu", cpu_kv_cache_bytes=2**20)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.cumulative_logprob


@pytest.fixture(scope="session")
def intact(tmp_path_factory):
    """base -> (its model path, its answer), built once."""
    built = {}

    def get(base: str):
        if base not in built:
            path = BASES[base](str(tmp_path_factory.mktemp(base)))
            built[base] = (path, answer(path))
        return built[base]
    return get


# ---------------------------------------------------------------------- the oracle


def check(path: str, fault: Fault | None, expected, capsys) -> None:
    """Loading `path` refuses naming `fault`, or answers `expected`; `inspect` reports without crashing."""
    try:
        got = answer(path)
    except RadianceError as exc:
        message = str(exc)
        assert fault is not None, f"an intact-looking checkpoint was refused: {message}"
        assert fault.named_by(message), f"the message does not name {fault}: {message}"
    else:
        assert got == expected, "accepted, but the model answers differently from the intact one"
    capsys.readouterr()
    rc = main(["inspect", path, "--strict", "--values"])
    captured = capsys.readouterr()
    assert rc in (0, 1, 2), rc
    if rc == 2:  # inspect could not even open it: its one line names the file like the load's error
        assert fault is not None and fault.named_by(captured.err), captured.err


# ---------------------------------------------------------------------- the cases

# kinds applied to every base of their list, `seeds` times each
PER_BASE = [
    (c.missing_tensor, SAFETENSORS_BASES, 2), (c.extra_tensor, SAFETENSORS_BASES, 2),
    (c.wrong_shape, SAFETENSORS_BASES, 2), (c.wrong_dtype, SAFETENSORS_BASES, 2),
    (c.nan_in_weights, SAFETENSORS_BASES, 2),
    (c.widened, [b for b in SAFETENSORS_BASES if b != "fp32"], 1),
    (c.quantization_config_garbage, QUANTIZED_BASES, 2), (c.scale_wrong_dtype, QUANTIZED_BASES, 2),
    (c.truncate, SAFETENSORS_BASES, 1),
]
# kinds whose effect does not depend on the weights' format: CASES_PER_KIND cases, spread over the bases
SPREAD = [
    (c.truncate, SAFETENSORS_BASES), (c.header_length_field, SAFETENSORS_BASES), (c.header_garbage, SAFETENSORS_BASES),
    (c.header_not_an_object, SAFETENSORS_BASES), (c.offsets_out_of_range, SAFETENSORS_BASES),
    (c.offsets_reversed, SAFETENSORS_BASES), (c.offsets_overlapping, SAFETENSORS_BASES),
    (c.offsets_not_integers, SAFETENSORS_BASES), (c.dtype_unknown, SAFETENSORS_BASES),
    (c.shape_not_matching_bytes, SAFETENSORS_BASES), (c.entry_not_an_object, SAFETENSORS_BASES),
    (c.config_missing_field, SAFETENSORS_BASES), (c.config_wrong_type, SAFETENSORS_BASES),
    (c.config_heads_disagree, SAFETENSORS_BASES), (c.config_garbage, SAFETENSORS_BASES),
    (c.index_names_a_missing_shard, ["sharded"]), (c.index_names_the_wrong_shard, ["sharded"]),
    (c.index_names_an_unknown_tensor, ["sharded"]), (c.index_forgets_a_tensor, ["sharded"]),
    (c.index_garbage, ["sharded"]),
    (c.gguf_magic, ["gguf"]), (c.gguf_version, ["gguf"]), (c.gguf_truncate, ["gguf"]), (c.gguf_metadata_type, ["gguf"]),
    (c.gguf_tensor_type, ["gguf"]), (c.gguf_tensor_dims, ["gguf"]), (c.gguf_nan, ["gguf"]),
    (c.gguf_metadata_values, ["gguf"]),
]
KINDS = {kind.__name__: kind for kind, *_ in PER_BASE + SPREAD}


def _cases() -> list:
    cases = [(base, kind.__name__, seed) for kind, bases, seeds in PER_BASE for base in bases for seed in range(seeds)]
    for number, (kind, bases) in enumerate(SPREAD):
        extra = 2 * CASES_PER_KIND if bases == ["gguf"] else CASES_PER_KIND  # one base: a few more draws
        cases += [(bases[(number + i) % len(bases)], kind.__name__, i) for i in range(extra)]
    return cases


@pytest.mark.parametrize("base, kind, seed", _cases())
def test_a_broken_checkpoint_is_refused_by_name_or_serves_as_the_intact_one(base, kind, seed, intact, tmp_path,
                                                                              capsys):
    source, expected = intact(base)
    if os.path.isdir(source):
        path = shutil.copytree(source, str(tmp_path / base))
    else:
        path = shutil.copy(source, str(tmp_path / os.path.basename(source)))
    fault = KINDS[kind](path, random.Random(f"{kind}/{base}/{seed}"))
    check(path, fault, expected, capsys)


# ---------------------------------------------------------------------- regressions: what the fuzz found


def _broken_copy(intact, tmp_path, base: str) -> str:
    return shutil.copytree(intact(base)[0], str(tmp_path / base))


def _refusal(path: str) -> str:
    with pytest.raises(RadianceError) as info:
        answer(path)
    return str(info.value)


@pytest.mark.parametrize("base", ["mxfp4-quark", "nvfp4-modelopt"])
def test_packed_codes_without_their_scale_name_the_scale(intact, tmp_path, base):
    """Quark and ModelOpt keep packed codes under `weight`: without weight_scale they were taken for a 16-bit weight
    ("wrong dtype uint8 for a 16-bit linear weight", naming the weight)."""
    path = _broken_copy(intact, tmp_path, base)
    c.rewrite(os.path.join(path, "model.safetensors"), lambda t: t.pop("model.layers.1.self_attn.v_proj.weight_scale"))
    assert "tensor model.layers.1.self_attn.v_proj.weight_scale)" in _refusal(path)


@pytest.mark.parametrize("offsets, says", [
    (lambda b, e: [e, b], "ends before it begins"), (lambda b, e: [b - 2, e - 2], "overlaps"),
    (lambda b, e: None, "not [begin, end]"), (lambda b, e: [b + 2, e + 2], "leaves a gap"),
])
def test_a_header_entry_safetensors_refuses_names_the_tensor(intact, tmp_path, offsets, says):
    """safetensors' own words ("invalid offset for tensor `x`", "invalid JSON in header ... column 3871") named no
    tensor radiance's way, or none at all."""
    path = _broken_copy(intact, tmp_path, "bf16")
    file, name = os.path.join(path, "model.safetensors"), "model.layers.1.mlp.up_proj.weight"
    st = Safetensors.read(file)
    st.header[name]["data_offsets"] = offsets(*st.header[name]["data_offsets"])
    st.write(file)
    message = _refusal(path)
    assert says in message and message.endswith(f"(file {file}, tensor {name})")


@pytest.mark.parametrize("change", [{"num_key_value_heads": 8}, {"rope_theta": {}}])
def test_a_config_fault_the_model_registry_finds_names_config_json(intact, tmp_path, change):
    path = _broken_copy(intact, tmp_path, "fp16")
    config_path, config = c.read_config(path)
    c.save_json(config_path, {**config, **change})
    assert _refusal(path).endswith(f"(file {config_path})")


@pytest.mark.parametrize("base, name", [("fp8-channel", "model.layers.1.self_attn.k_proj.weight_scale"),
                                        ("fp8-block", "model.layers.0.self_attn.q_proj.weight_scale_inv")])
def test_transposed_fp8_scales_are_refused(intact, tmp_path, base, name):
    """A per-channel [N, 1] scale stored [1, N] was read as block scales, and hf-fp8's [2, 1] blocks stored [1, 2] as
    other blocks: both served a different model without a word."""
    path = _broken_copy(intact, tmp_path, base)
    c.rewrite(os.path.join(path, "model.safetensors"), lambda t: t.__setitem__(name, t[name].t().contiguous()))
    assert _refusal(path).endswith(f"(file {os.path.join(path, 'model.safetensors')}, tensor {name})")


def test_an_integer_plain_tensor_is_refused(intact, tmp_path):
    """gpt-oss's router bias stored as bool was copied into the float parameter (as 0 / 1) and served."""
    path, name = _broken_copy(intact, tmp_path, "mxfp4-gptoss"), "model.layers.0.mlp.router.bias"
    c.rewrite(os.path.join(path, "model.safetensors"), lambda t: t.__setitem__(name, t[name].bool()))
    assert "wrong dtype bool" in _refusal(path)


def test_a_merged_bias_of_the_wrong_length_names_its_part_and_file(intact, tmp_path):
    """A q_proj.bias one too long was refused as the merged qkv_proj.bias, naming the directory, not the file."""
    path, name = _broken_copy(intact, tmp_path, "mxfp4-gptoss"), "model.layers.0.self_attn.q_proj.bias"
    c.rewrite(os.path.join(path, "model.safetensors"), lambda t: t.__setitem__(name, torch.cat([t[name], t[name][:1]])))
    assert _refusal(path).endswith(f"(file {os.path.join(path, 'model.safetensors')}, tensor {name})")
