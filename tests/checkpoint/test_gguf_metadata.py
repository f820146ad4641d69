"""GGUF files as llama.cpp writes them for models other than the embedded one: no tokenizer, other
architectures, rope scaling (metadata or Llama 3's rope_freqs tensor), tensor types radiance cannot read,
tensors it has no place for, and the same one-line refusals the HF path gives."""

import os

import gguf
import numpy as np
import pytest
import torch

from radiance.checkpoint import open_checkpoint
from radiance.checkpoint.servable import architecture_problem, check_servable
from radiance.errors import CheckpointError, ConfigError
from radiance.layers.rotary import rope_inv_freq
from radiance.models.registry import resolve_architecture

T = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 2, 96


def write_gguf(path, arch="llama", metadata=None, extra_tensors=None, types=None, head_dim=HIDDEN // HEADS,
               overrides=None, nan_in=None, without=()):
    """A one-layer model, no tokenizer metadata; `types` {gguf name: GGML type} for the linears, `overrides`
    metadata replacing the sizes the tensors are written with, `nan_in` an F32 tensor given one NaN, `without`
    metadata keys left out."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {f"{arch}.block_count": 1, f"{arch}.context_length": 4096, f"{arch}.embedding_length": HIDDEN,
             f"{arch}.feed_forward_length": FFN, f"{arch}.attention.head_count": HEADS,
             f"{arch}.attention.head_count_kv": KV_HEADS}
    if head_dim != HIDDEN // HEADS:
        sizes.update({f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim})
    metadata = {**sizes, f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
                **(metadata or {}), **(overrides or {})}
    for key in without:
        del metadata[key]
    for key, value in metadata.items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32, bool: writer.add_bool,
         list: writer.add_array}[type(value)](key, value)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HEADS * head_dim),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name == nan_in:
            values.flat[3] = np.nan
        qtype = (types or {}).get(name, T.F32)
        if qtype == T.F32:
            writer.add_tensor(name, values)
        else:  # raw blocks (small bytes: every fp16 scale finite)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 0x30, size=(shape[0], shape[1] // block * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_no_tokenizer_metadata_takes_the_vocabulary_size_from_the_embedding(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf"))
    assert ckpt.config["vocab_size"] == VOCAB
    check_servable(ckpt)  # was a TypeError building the embedding of vocab_size None
    with pytest.raises(CheckpointError, match="tokenizer"):
        ckpt.tokenizer()


@pytest.mark.parametrize("arch", ["starcoder2", "falcon", "deepseek2"])
def test_an_unread_architecture_is_the_registrys_one_line(tmp_path, arch):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", arch=arch))  # opens, so inspect can report it
    with pytest.raises(ConfigError) as err:
        check_servable(ckpt)
    assert str(err.value) == architecture_problem(ckpt)
    assert str(err.value).startswith(f"unsupported model architecture {arch}; radiance serves ")


def test_linear_and_yarn_rope_scaling_reach_the_model(tmp_path):
    linear = open_checkpoint(write_gguf(tmp_path / "linear.gguf", metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    _, cfg = resolve_architecture(linear.config)
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 4.0
    yarn = open_checkpoint(write_gguf(tmp_path / "yarn.gguf", metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 1024}))
    _, cfg = resolve_architecture(yarn.config)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    none = open_checkpoint(write_gguf(tmp_path / "none.gguf", metadata={"llama.rope.scaling.type": "none"}))
    assert resolve_architecture(none.config)[1].rope_scaling is None


def test_an_unsupported_rope_scaling_is_refused_in_one_line(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        "llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}))
    with pytest.raises(ConfigError, match="longrope rope_scaling needs 'short_factor'"):  # no factor tensors
        check_servable(ckpt)


def llama3_rope_factors(head_dim, theta, factor, low, high, old_len):
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for a Llama 3.1 config."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("head_dim, theta, factor", [(64, 500000.0, 32.0), (128, 500000.0, 8.0)])
def test_llama3_rope_freqs_become_the_llama3_rope_scaling(tmp_path, head_dim, theta, factor):
    """Llama 3.1 / 3.2 GGUF files carry their rope scaling as a rope_freqs tensor of per-frequency divisors."""
    factors = llama3_rope_factors(head_dim, theta, factor, 1.0, 4.0, 8192)
    path = write_gguf(tmp_path / "m.gguf", metadata={"llama.rope.freq_base": theta}, head_dim=head_dim,
                      extra_tensors={"rope_freqs.weight": factors})
    ckpt = open_checkpoint(path)
    check_servable(ckpt)  # rope_freqs is read, not an unused tensor
    _, cfg = resolve_architecture(ckpt.config)
    want = rope_inv_freq(head_dim, theta, None) / torch.from_numpy(factors)
    got = rope_inv_freq(head_dim, theta, cfg.rope_scaling)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=0)


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    factors = np.linspace(1.0, 3.0, HIDDEN // HEADS // 2, dtype=np.float32)[::-1].copy()  # falling: not llama3
    path = write_gguf(tmp_path / "m.gguf", extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(CheckpointError, match="rope_freqs") as err:
        open_checkpoint(path)
    assert err.value.tensor == "rope_freqs.weight"


@pytest.mark.parametrize("qtype", [T.Q8_1, T.I8])
def test_an_unreadable_tensor_type_names_tensor_type_and_the_readable_ones(tmp_path, qtype):
    path = write_gguf(tmp_path / "m.gguf", types={"blk.0.ffn_up.weight": qtype})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)  # at once: not after reading the tensors before it (convert, load)
    message = str(err.value)
    assert err.value.tensor == "blk.0.ffn_up.weight" and f"type {qtype.name}" in message
    assert "\n" not in message and all(t in message for t in ("F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"))


@pytest.mark.parametrize("qtype", [T.Q5_0, T.IQ4_NL, T.BF16])
def test_other_types_are_dequantized_as_gguf_py_does(tmp_path, qtype):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", types={"blk.0.ffn_down.weight": qtype}))
    t = ckpt.tensors["blk.0.ffn_down.weight"]
    weight = dict(ckpt.iter_weights(progress=False))["model.layers.0.mlp.down_proj"]
    assert torch.equal(weight.tensor, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))


def test_a_tensor_radiance_has_no_place_for_is_reported_not_dropped(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.ffn_gate_inp_shexp.weight": np.zeros((1, HIDDEN),
                                                                                               np.float32)})
    with pytest.raises(CheckpointError, match="not used") as err:
        check_servable(open_checkpoint(path))
    assert err.value.tensor == "blk.0.ffn_gate_inp_shexp.weight"


def test_llama_attention_bias_includes_the_output_bias(tmp_path):
    biases = {f"blk.0.attn_{p}.bias": np.full(n, 0.5, np.float32)
              for p, n in (("q", HIDDEN), ("k", KV_HEADS * 16), ("v", KV_HEADS * 16), ("output", HIDDEN))}
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", extra_tensors=biases))
    check_servable(ckpt)  # the o_proj bias was dropped: the model then lacked model.layers.0.self_attn.o_bias
    assert torch.equal(dict(ckpt.iter_weights(progress=False))["model.layers.0.self_attn.o_proj.bias"],
                       torch.full((HIDDEN,), 0.5))


def write_split(tmp_path, parts_kept=None):
    """The one-layer model written by gguf-py in parts of 4 tensors (model-0000N-of-00003.gguf)."""
    single = write_gguf(tmp_path / "single.gguf")
    reader = open_checkpoint(single)
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama", split_max_tensors=4)
    for key, value in reader.file.metadata.items():
        if key not in ("general.architecture", "general.alignment"):
            {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    for t in reader.file.tensors:
        writer.add_tensor(t.name, np.array(t.data).view(np.float32).reshape(*reversed(t.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reader, [str(tmp_path / f"model-0000{i}-of-00003.gguf") for i in (1, 2, 3)]


def test_a_split_gguf_reads_all_its_parts(tmp_path):
    single, parts = write_split(tmp_path)
    ckpt = open_checkpoint(parts[0])
    check_servable(ckpt)  # was: lacks the weights of parts 2 and 3
    got, want = dict(ckpt.iter_weights(progress=False)), dict(single.iter_weights(progress=False))
    assert got.keys() == want.keys()
    assert all(torch.equal(torch.as_tensor(getattr(got[k], "tensor", got[k])),
                           torch.as_tensor(getattr(want[k], "tensor", want[k]))) for k in want)


def test_a_later_or_missing_part_of_a_split_gguf_is_one_line(tmp_path):
    _, parts = write_split(tmp_path)
    with pytest.raises(CheckpointError, match="part 2 of 3 .*model-00001-of-00003.gguf"):
        open_checkpoint(parts[1])
    (tmp_path / "model-00003-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="part 3 of 3 .* missing") as err:
        open_checkpoint(parts[0])
    assert err.value.file == parts[2]


@pytest.mark.parametrize("metadata, tensor", [
    ({"llama.feed_forward_length": 96}, "blk.0.ffn_gate.weight"),
    ({"llama.vocab_size": 90}, "token_embd.weight"),
    ({"llama.attention.head_count_kv": 1}, "blk.0.attn_k.weight"),
])
def test_a_tensor_that_disagrees_with_the_metadata_is_named_at_open(tmp_path, metadata, tensor):
    """Was: opened, inspected and converted; loading failed only after reading the tensors before it,
    naming the merged linear (model.layers.0.mlp.gate_up_proj) instead of the GGUF tensor."""
    path = write_gguf(tmp_path / "m.gguf", overrides=metadata)
    with pytest.raises(CheckpointError, match="GGUF tensor of shape .* its metadata describes has") as err:
        open_checkpoint(path)
    assert err.value.tensor == tensor and err.value.file == path


def test_a_tensor_in_two_parts_of_a_split_gguf_is_refused(tmp_path):
    """Was: the later part's tensor silently replaced the first's (the tensor count still adding up)."""
    from radiance.checkpoint.gguf_file import GgufFile

    _, parts = write_split(tmp_path)
    first = GgufFile(parts[0]).tensors[0]
    third = GgufFile(parts[2])
    writer = gguf.GGUFWriter(parts[2] + ".new", "llama")  # part 3 with part 1's first tensor for its last one
    writer.add_uint16("split.no", 2)
    writer.add_uint16("split.count", 3)
    for t in third.tensors[:-1] + [first]:
        writer.add_tensor(t.name, np.array(t.data).view(np.float32).reshape(*reversed(t.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(parts[2] + ".new", parts[2])
    with pytest.raises(CheckpointError, match="appears in two parts") as err:
        open_checkpoint(parts[0])
    assert err.value.tensor == first.name and err.value.file == parts[2]


def test_a_per_layer_kv_head_count_is_read_when_uniform_and_refused_when_not(tmp_path):
    """Was: int() of the array, a TypeError traceback."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "same.gguf", overrides={"llama.attention.head_count_kv": [KV_HEADS]}))
    assert ckpt.config["num_key_value_heads"] == KV_HEADS
    with pytest.raises(CheckpointError, match="head_count_kv differs per layer"):
        open_checkpoint(write_gguf(tmp_path / "mixed.gguf", metadata={"llama.block_count": 2},
                                   overrides={"llama.attention.head_count_kv": [KV_HEADS, 1]}))


def test_float32_metadata_reads_as_the_decimal_it_was_written_from(tmp_path):
    """Was: rms_norm_eps 9.999999747378752e-06 for 1e-5 (in the config convert writes, too)."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.5, "llama.rope.scaling.yarn_beta_fast": 0.3,
        "llama.rope.freq_base": 1e6}))
    assert ckpt.config["rms_norm_eps"] == 1e-5 and ckpt.config["rope_theta"] == 1e6
    assert ckpt.config["rope_parameters"]["factor"] == 2.5 and ckpt.config["rope_parameters"]["beta_fast"] == 0.3


def test_a_lora_adapter_gguf_is_named_as_such(tmp_path):
    """Was: "GGUF metadata llama.embedding_length is missing" (an adapter has none)."""
    writer = gguf.GGUFWriter(str(tmp_path / "lora.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string("adapter.type", "lora")
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((8, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="general.type is 'adapter' \\(a LoRA adapter.*not a model"):
        open_checkpoint(str(tmp_path / "lora.gguf"))
