"""Config values that loaded wrongly or died in a traceback (a black-box hunt over broken checkpoints): a context of
10**12 positions, NaN / inf numbers, a boolean written as a string, a bad regex in the checkpoint's own ignore list,
a chat template that is not text."""

import json
import os

import pytest
import torch

from radiance.cli import main
from radiance.engine.llm import LLM
from radiance.engine.sampling_params import SamplingParams
from radiance.errors import CheckpointError, ConfigError
from radiance.layers.rotary import EAGER_TABLE_POSITIONS, RotaryEmbedding
from tests.checkpoint.factory import CT_NVFP4_CONFIG, TINY, ct_nvfp4_tensors, dense_state_dict, linear_modules, write_dir


def _rotaries(llm):
    return [m for m in llm.engine.model.modules() if isinstance(m, RotaryEmbedding)]


@pytest.mark.parametrize("max_model_len", [64, None])
def test_a_huge_context_loads_with_rotary_tables_for_the_served_length(tmp_path, max_model_len):
    """The cos / sin tables were built for the whole context: 10**12 positions died allocating 4 TB (and 2**26 took
    8.7 GB on a 2-layer toy); now they cover what is served (the KV cache caps it without --max-model-len)."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), dict(TINY, max_position_embeddings=10**12))
    llm = LLM(model=path, device="cpu", max_model_len=max_model_len, cpu_kv_cache_bytes=2**20)
    served = llm.engine.max_model_len
    assert served == (max_model_len or served) and served < 10**6
    assert all(r.table_positions == served for r in _rotaries(llm))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_tables_cover_an_evals_chunks_with_the_same_angles():
    """Without an engine the tables start at EAGER_TABLE_POSITIONS rows; `cover` grows them to a chunk's length."""
    rotary = RotaryEmbedding(16, 10**9, 10000.0)
    first = rotary.cos.clone()
    assert rotary.table_positions == EAGER_TABLE_POSITIONS
    rotary.cover(EAGER_TABLE_POSITIONS + 5)
    assert rotary.table_positions == EAGER_TABLE_POSITIONS + 5
    assert torch.equal(rotary.cos[:EAGER_TABLE_POSITIONS], first)
    position = EAGER_TABLE_POSITIONS + 4
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    expected = torch.cos(position * inv_freq.float().double())
    assert torch.allclose(rotary.cos[-1].double(), expected, atol=1e-3)
    rotary.cover(10)  # never shrinks: a later, shorter chunk keeps the rows
    assert rotary.table_positions == EAGER_TABLE_POSITIONS + 5


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"radiance {command}: error:"), err
    return err[0]


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_a_bad_regex_in_the_quantization_config_is_one_line(tmp_path, capsys, where):
    """Was re.error with a traceback from inspect, generate and serve (the CLI's own --ignore was checked)."""
    group = {"targets": ["re:(" if where == "targets" else "Linear"],
             "weights": {"num_bits": 4, "type": "float", "group_size": 32}}
    qc = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {"g": group},
          "ignore": ["lm_head"] + (["re:("] if where == "ignore" else [])}
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, quantization_config=qc)
    assert main(["inspect", path]) == 2
    err = _one_error_line(capsys, "inspect")
    assert "quantization_config pattern 're:(' is not a valid regular expression" in err and "config.json" in err


@pytest.mark.parametrize("template, message", [
    (42, "chat_template must be text (a jinja template) or a list of {name, template}, got int"),
    ([{"name": "default"}], "chat_template, a list, must hold"),
])
@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_a_chat_template_that_is_not_text_names_the_file(tmp_path, capsys, template, message, command):
    """Was: generate died in jinja ("Can't compile non template nodes"), serve said "no chat template"."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, tokenizer=True)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    with open(config_path, "w") as handle:
        json.dump(dict(config, chat_template=template), handle)
    argv = ["inspect", path] if command == "inspect" else ["generate", "w3 w4", "--model", path, "--device", "cpu", "--no-progress"]
    assert main(argv) == 2
    err = _one_error_line(capsys, command)
    assert message in err and config_path in err


def test_a_gguf_chat_template_that_is_not_a_string_names_the_key(tmp_path, capsys):
    """Was: serve died in a TypeError traceback (joining the templates), generate in jinja."""
    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, metadata={"tokenizer.chat_template": 7})
    assert main(["inspect", str(path)]) == 2
    err = _one_error_line(capsys, "inspect")
    assert "GGUF metadata tokenizer.chat_template must be a string (a jinja template), got int" in err
    assert str(path) in err


@pytest.mark.parametrize("changes, named", [
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a positive number, got nan"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps' must be a positive number, got inf"),
    ({"rope_theta": float("nan")}, "'rope_theta' must be a positive number, got nan"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, "needs a positive number for 'factor'"),
])
def test_nan_and_infinity_config_numbers_are_refused(tmp_path, capsys, changes, named):
    """Python's json reads NaN / Infinity; they passed `<= 0` checks and served empty answers, exit 0."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), dict(TINY, **changes), tokenizer=True)
    assert main(["inspect", path, "--strict"]) == 1
    servable = [line for line in capsys.readouterr().out.splitlines() if line.startswith("servable ")]
    assert servable[0].startswith("servable   NO: ") and named in servable[0]
    assert main(["generate", "w3", "--model", path, "--device", "cpu", "--no-progress"]) == 2
    assert named in _one_error_line(capsys, "generate")


def test_a_nan_gguf_epsilon_is_refused(tmp_path, capsys):
    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, overrides={"llama.attention.layer_norm_rms_epsilon": float("nan")})
    assert main(["inspect", str(path), "--strict"]) == 1
    assert ("servable   NO: GGUF metadata llama.attention.layer_norm_rms_epsilon must be a positive number, got nan "
            f"(file {path})") in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    ({"llama.rope.freq_base": 0.0}, "GGUF metadata llama.rope.freq_base must be a positive number, got 0.0"),
    ({"llama.attention.head_count_kv": 3}, "GGUF metadata of a LlamaForCausalLM model: num_attention_heads 4 is not a "
     "multiple of num_key_value_heads 3 (num_attention_heads is llama.attention.head_count, num_key_value_heads is "
     "llama.attention.head_count_kv)"),
])
@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_a_gguf_metadata_fault_names_its_key_and_file(tmp_path, capsys, overrides, message, command):
    """Was worded for a config.json the GGUF does not have ("config.json field 'rope_theta' ...") and named no file."""
    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = write_gguf(tmp_path / "m.gguf", overrides=overrides)
    if command == "inspect":
        assert main(["inspect", path, "--strict"]) == 1
        assert f"servable   NO: {message} (file {path})" in capsys.readouterr().out
    else:  # loading for serving (the file has no tokenizer: the engine API, on token ids)
        with pytest.raises(ConfigError) as err:
            LLM(model=path, device="cpu")
        assert str(err.value) == f"{message} (file {path})"


def test_a_nan_in_a_gguf_tensor_names_the_gguf_tensor(tmp_path):
    """Was named by its transformers name (model.layers.0.self_attn.k_proj.weight), which the file does not hold."""
    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = write_gguf(tmp_path / "m.gguf", nan_in="blk.0.attn_k.weight")
    with pytest.raises(CheckpointError) as err:
        LLM(model=path, device="cpu")
    assert str(err.value).endswith(f"(file {path}, tensor blk.0.attn_k.weight)") and "1 NaN" in str(err.value)


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias"])
def test_a_switch_written_as_a_string_is_refused(tmp_path, capsys, key):
    """"false" counted as true: lm_head.weight was dropped for the embeddings and the answers changed, silently."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), dict(TINY, **{key: "false"}), tokenizer=True)
    assert main(["inspect", path]) == 2
    err = _one_error_line(capsys, "inspect")
    assert f"config.json field {key!r} must be true or false, got 'false'" in err


@pytest.mark.parametrize("missing, hf", [("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
                                         ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight")])
def test_a_gguf_missing_one_part_of_a_merged_linear_names_it(tmp_path, capsys, missing, hf):
    """Was: `inspect --strict` said servable, then loading failed on a qkv_proj / gate_up_proj of the wrong shape
    (a name the file does not have)."""
    import gguf

    from tests.checkpoint.test_gguf_metadata import write_gguf

    full, path = tmp_path / "full.gguf", tmp_path / "m.gguf"
    write_gguf(full)
    reader = gguf.GGUFReader(str(full))
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](field.name, value)
    for tensor in reader.tensors:
        if tensor.name != missing:
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["inspect", str(path), "--strict"]) == 2
    err = _one_error_line(capsys, "inspect")
    assert f"tensor missing from the GGUF file ({hf} in transformers' names)" in err
    assert f"(file {path}, tensor {missing})" in err


@pytest.mark.parametrize("shift", [4, 32, "onto attn_q"])
def test_a_gguf_tensor_offset_out_of_place_is_refused(tmp_path, capsys, shift):
    """A tensor's offset moved off its place (misaligned, one alignment further, onto another tensor's bytes) was
    read as it stood; llama.cpp refuses such a file, and so does radiance now."""
    import struct

    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path)
    raw = bytearray(path.read_bytes())

    def offset_at(name: bytes) -> int:  # the u64 offset after the name, its dims and its type
        at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        n_dims = struct.unpack_from("<I", raw, at)[0]
        return at + 4 + 8 * n_dims + 4

    k_at = offset_at(b"blk.0.attn_k.weight")
    old = struct.unpack_from("<Q", raw, k_at)[0]
    new = struct.unpack_from("<Q", raw, offset_at(b"blk.0.attn_q.weight"))[0] if shift == "onto attn_q" \
        else old + shift
    struct.pack_into("<Q", raw, k_at, new)
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(path)]) == 2
    err = _one_error_line(capsys, "inspect")
    assert f"GGUF tensor data at offset {new}, expected {old}" in err and "tensor blk.0.attn_k.weight" in err


@pytest.mark.parametrize("tensor", ["model.layers.1.post_attention_layernorm.weight", "model.embed_tokens.weight",
                                    "lm_head.weight"])
def test_convert_refuses_a_nan_it_would_copy(tmp_path, capsys, tensor):
    """Norms, embeddings and the 16-bit head were copied NaN and all (exit 0); loading the result then refused it,
    naming the new file. Now convert names the source's tensor and writes nothing."""
    tensors = dense_state_dict()
    tensors[tensor].view(-1)[3] = float("nan")
    path = write_dir(str(tmp_path / "src"), tensors, TINY, tokenizer=True)
    dst = tmp_path / "out"
    assert main(["convert", path, str(dst), "--no-progress"]) == 2
    err = _one_error_line(capsys, "convert")
    assert "1 NaN or inf value(s): refusing to write them" in err and f"tensor {tensor})" in err
    assert "model.safetensors" in err and not (dst / "config.json").exists()


def test_a_linear_of_a_layer_past_the_config_is_named_as_unused(tmp_path, capsys):
    """One extra q_proj for layer 2 of a 2-layer config was reported as its k_proj missing, naming the directory."""
    tensors = dense_state_dict()
    tensors["model.layers.2.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].clone()
    path = write_dir(str(tmp_path / "m"), tensors, TINY, tokenizer=True)
    assert main(["inspect", path]) == 2
    err = _one_error_line(capsys, "inspect")
    assert "tensor of layer 2, but config.json has num_hidden_layers 2: not used by the model" in err
    assert "model.safetensors, tensor model.layers.2.self_attn.q_proj.weight)" in err


def test_a_config_without_vocab_size_names_the_key(tmp_path, capsys):
    """Was "wrong shape [128, 64] for a 16-bit linear weight, expected [0, 64] (tensor lm_head.weight)"."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), {k: v for k, v in TINY.items() if k != "vocab_size"})
    assert main(["inspect", path]) == 0  # inspect reports; --strict would exit 1 on it
    out = capsys.readouterr().out
    assert "servable   NO: config.json of a LlamaForCausalLM model lacks 'vocab_size'" in out


@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_an_unexpected_bias_is_named_as_the_checkpoint_stores_it(tmp_path, capsys, command):
    """Was named by the merged module radiance builds (qkv_proj.bias), with the directory as the file."""
    tensors = dense_state_dict()
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(tensors["model.layers.0.self_attn.q_proj.weight"]
                                                                  .shape[0])
    path = write_dir(str(tmp_path / "m"), tensors, TINY, tokenizer=True)
    named = f"(file {path}/model.safetensors, tensor model.layers.0.self_attn.q_proj.bias)"
    if command == "inspect":
        assert main(["inspect", path, "--strict"]) == 1
        assert named in capsys.readouterr().out
    else:
        assert main(["generate", "w3", "--model", path, "--device", "cpu", "--no-progress"]) == 2
        assert named in _one_error_line(capsys, "generate")


@pytest.mark.parametrize("dtype, shape, message", [
    ("F4", None, "dtype 'F4' is not one safetensors reads"),
    ("I64", None, "shape [32, 64] of I64 needs 16384 bytes, the header gives it 4096"),
    (None, [16, 64], "shape [16, 64] of BF16 needs 2048 bytes, the header gives it 4096"),
])
def test_a_header_entry_safetensors_refuses_is_named(tmp_path, capsys, dtype, shape, message):
    """safetensors says "invalid shape, data type, or offset for tensor" and names none."""
    import struct

    tensors = {k: v.to(torch.bfloat16) for k, v in dense_state_dict().items()}
    path = write_dir(str(tmp_path / "m"), tensors, TINY, tokenizer=True)
    file = os.path.join(path, "model.safetensors")
    raw = open(file, "rb").read()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    name = "model.layers.1.self_attn.k_proj.weight"
    assert header[name]["dtype"] == "BF16" and header[name]["shape"] == [32, 64]
    header[name].update({k: v for k, v in (("dtype", dtype), ("shape", shape)) if v is not None})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))  # same length: the data stays where it was
    assert len(text) == length
    with open(file, "wb") as handle:
        handle.write(raw[:8] + text + raw[8 + length:])
    assert main(["inspect", path]) == 2
    err = _one_error_line(capsys, "inspect")
    assert message in err and f"(file {file}, tensor {name})" in err


@pytest.mark.parametrize("name, text", [("tokenizer.json", '{"version": "1.0", "model": {'),
                                        ("special_tokens_map.json", '{"bos_token": ')])
def test_a_tokenizer_file_that_is_not_json_is_named(tmp_path, capsys, name, text):
    """Was "cannot load the tokenizer: Expecting value: line 1 column 4 (file <the directory>)"."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, tokenizer=True)
    with open(os.path.join(path, name), "w") as handle:
        handle.write(text)
    assert main(["inspect", path, "--tokenizer"]) == 2
    err = _one_error_line(capsys, "inspect")
    assert f"{name} is not valid JSON" in err and f"(file {os.path.join(path, name)})" in err
    # convert copied it to DST without a word (and DST then failed to load)
    dst = tmp_path / "out"
    assert main(["convert", path, str(dst), "--no-progress"]) == 2
    err = _one_error_line(capsys, "convert")
    assert f"{name} is not valid JSON" in err and not dst.exists()


K_PROJ = "model.layers.1.self_attn.k_proj"


@pytest.mark.parametrize("case", ["unknown leaf", "16-bit weight beside nvfp4"])
@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_a_linear_tensor_its_format_does_not_read_is_named(tmp_path, capsys, case, command):
    """An unknown leaf of a linear (k_proj.weight_foo), or a 16-bit `weight` left beside packed codes, was dropped
    without a word (every other unused tensor was refused)."""
    tensors = dense_state_dict()
    quantization_config = None
    if case == "unknown leaf":
        stray, read = f"{K_PROJ}.weight_foo", "dense from weight"
        tensors[stray] = torch.zeros(4)
    else:
        stray, read = f"{K_PROJ}.weight", "nvfp4 from weight_global_scale, weight_packed, weight_scale"
        dense = tensors[stray].clone()
        tensors = ct_nvfp4_tensors(tensors, linear_modules())
        tensors[stray] = dense
        quantization_config = CT_NVFP4_CONFIG
    path = write_dir(str(tmp_path / "m"), tensors, TINY, quantization_config, tokenizer=True)
    args = ["inspect", path] if command == "inspect" else ["generate", "w3", "--model", path, "--device", "cpu",
                                                           "--no-progress"]
    assert main(args) == 2
    line = _one_error_line(capsys, command)
    assert f"tensor not used by the model: {K_PROJ} is read as {read}" in line
    assert f"(file {path}/model.safetensors, tensor {stray})" in line


def test_side_leaves_of_a_linear_stay_accepted(tmp_path, capsys):
    """Activation scales and zero points of a scheme served with dynamic activations, and compressed-tensors'
    weight_shape, are not the weight: they load as before."""
    tensors = ct_nvfp4_tensors(dense_state_dict(), linear_modules())
    tensors[f"{K_PROJ}.input_global_scale"] = torch.ones(1)
    tensors[f"{K_PROJ}.weight_shape"] = torch.tensor([32, 64])
    path = write_dir(str(tmp_path / "m"), tensors, TINY, CT_NVFP4_CONFIG, tokenizer=True)
    assert main(["inspect", path]) == 0
    assert "servable   yes" in capsys.readouterr().out


def test_a_tokenizer_json_of_another_shape_is_named(tmp_path, capsys):
    """JSON that is no tokenizer ({"hello": 1}) read "cannot load the tokenizer: 'added_tokens' (file <the directory>)"."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, tokenizer=True)
    with open(os.path.join(path, "tokenizer.json"), "w") as handle:
        handle.write('{"hello": 1}')
    assert main(["inspect", path, "--tokenizer"]) == 2
    err = _one_error_line(capsys, "inspect")
    assert "tokenizer.json is JSON but not a tokenizer" in err
    assert err.endswith(f"(file {os.path.join(path, 'tokenizer.json')})")


def test_a_config_transformers_cannot_read_still_gives_the_tokenizer(tmp_path, caplog):
    """transformers reads config.json to choose a tokenizer: a `torch_dtype` torch lacks (which radiance, choosing its
    own dtype, serves) made the tokenizer fail, and a server answered token ids only. The tokenizer now loads without
    the config, the same ids as with a readable one, and a warning names the file and the fault."""
    from radiance.checkpoint import open_checkpoint

    good = write_dir(str(tmp_path / "good"), dense_state_dict(), TINY, tokenizer=True)
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), {**TINY, "torch_dtype": "float128"}, tokenizer=True)
    with caplog.at_level("WARNING", logger="radiance"):
        tokenizer = open_checkpoint(path).tokenizer()
    text = "The quick brown fox"
    assert tokenizer.encode(text) == open_checkpoint(good).tokenizer().encode(text)
    assert f"transformers cannot read {path}/config.json (module 'torch' has no attribute 'float128')" in caplog.text


def test_a_directory_with_no_tokenizer_files_says_so(tmp_path, capsys):
    """Was transformers' five-line "Couldn't instantiate the backend tokenizer ... install sentencepiece"."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY, tokenizer=False)
    assert main(["generate", "hi", "--model", path, "--device", "cpu", "--no-progress"]) == 2
    err = _one_error_line(capsys, "generate")
    assert "no tokenizer files (none of tokenizer.json" in err and f"(file {path})" in err


@pytest.mark.parametrize("fault, message", [
    ("scores", "GGUF metadata tokenizer.ggml.scores has 5 entries for the 96 tokens of tokenizer.ggml.tokens"),
    ("token_type", "GGUF metadata tokenizer.ggml.token_type has 5 entries for the 96 tokens of tokenizer.ggml.tokens"),
    ("merges", "GGUF metadata tokenizer.ggml.merges is missing or empty: a gpt2 (BPE) tokenizer cannot be built"),
])
def test_gguf_token_lists_that_do_not_fit_are_refused(tmp_path, capsys, fault, message):
    """Were accepted: scores / token types shorter than the token list, and a gpt2 vocabulary without merges
    (transformers then split every text into single characters; llama.cpp refuses that file)."""
    from tests.checkpoint.test_gguf_chat_templates import spm_tokenizer
    from tests.checkpoint.test_gguf_metadata import VOCAB, write_gguf
    from tests.checkpoint.test_models_followups import bpe_tokenizer

    assert VOCAB == 96  # the count the messages name
    if fault == "merges":
        metadata = {**bpe_tokenizer(["<|endoftext|>"], eos=0), "tokenizer.ggml.merges": []}
    else:
        metadata = spm_tokenizer()
        metadata[f"tokenizer.ggml.{fault}"] = metadata[f"tokenizer.ggml.{fault}"][:5]
    path = write_gguf(tmp_path / "m.gguf", metadata=metadata)
    assert main(["inspect", path, "--tokenizer"]) == 2
    err = _one_error_line(capsys, "inspect")
    assert message in err and err.endswith(f"(file {path})"), err


def test_a_gguf_without_context_length_warns(tmp_path, capsys):
    """llama.cpp refuses such a file; radiance serves it at 2048 tokens, and now says so."""
    from tests.checkpoint.test_gguf_metadata import write_gguf

    path = write_gguf(tmp_path / "m.gguf", without=("llama.context_length",))
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "GGUF metadata llama.context_length is missing: the context is taken to be 2048 tokens" in out
    assert "max len 2048" in out
