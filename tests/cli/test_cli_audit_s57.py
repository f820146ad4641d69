"""The s57 audit's `radiance generate` findings: the exit status of a constrained output cut by --max-tokens came from
a guess per constraint kind (a grammar's whole answer exited 1, a cut integer under a schema's minimum exited 0), a
model without a tokenizer was refused only after every weight and the KV cache (with transformers' "install
sentencepiece or tiktoken"), and the KV cache's too-small error named config fields, not the flags typed."""

from __future__ import annotations

import json
import types

import pytest
import torch

from radiance.cli import main
from radiance.config import CacheConfig, SchedulerConfig
from radiance.engine import cli as generate_cli
from radiance.engine.llm import LLM
from radiance.engine.structured_output import GrammarBackend, StructuredOutput
from radiance.errors import ConfigError
from tests.checkpoint.factory import TINY, dense_state_dict, write_dir
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer

YES_NO = 'root ::= "yes" | "no"'
BIG_INTEGER = '{"type": "integer", "minimum": 1000}'


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_byte_bpe_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, TINY_TOKENIZER_VOCAB, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with a real byte-level BPE tokenizer (no chat template: the prompt goes in raw)."""
    config = {**TINY, "vocab_size": TINY_TOKENIZER_VOCAB, "eos_token_id": tokenizer.eos_token_id,
              "bos_token_id": None}
    path = write_dir(str(tmp_path_factory.mktemp("s57") / "m"), dense_state_dict(config), config)
    tokenizer.save_pretrained(path)
    return path


def _generate(path, *flags) -> list[str]:
    return ["generate", "Paris is", "--model", path, "--device", "cpu", "--no-progress", *flags]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("radiance generate: error: "), err
    return err


# ------------------------------------------------------------------------------ 1. a cut constraint's exit status


@pytest.mark.parametrize("spec, text, whole", [
    (StructuredOutput(grammar=YES_NO), "no", True),  # was taken as cut: a grammar's answer was never checked
    (StructuredOutput(grammar=YES_NO), "n", False),
    (StructuredOutput(json=BIG_INTEGER), "1", False),  # was whole: json.loads reads it, the schema refuses it
    (StructuredOutput(json=BIG_INTEGER), "1000", True),
    (StructuredOutput(regex="[0-9]+"), "100", True),
    (StructuredOutput(json_object=True), '{"a": 1}', True),
    (StructuredOutput(json_object=True), '{"a": 1', False),
    (StructuredOutput(choice=("yes", "no")), "yes", True),
    (StructuredOutput(choice=("yes", "no")), "ye", False),
    (StructuredOutput(choice=("yes", "no")), "x", False),  # a token the constraint refuses
], ids=lambda value: value.kind if isinstance(value, StructuredOutput) else repr(value))
def test_a_cut_output_is_whole_when_the_constraints_matcher_can_end_there(backend, tokenizer, spec, text, whole):
    engine = types.SimpleNamespace(grammar_backend=lambda: backend)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert generate_cli._complete_under(engine, spec, ids) is whole


def test_a_grammar_answer_whole_at_the_cut_exits_0(model_dir, capsys, caplog, tmp_path):
    """`--grammar 'root ::= "yes" | "no"' --max-tokens 1` printed `no` and exited 1, saying it was cut. Here every
    one-token answer the grammar allows ("a" or "b") is whole."""
    grammar = tmp_path / "ab.gbnf"
    grammar.write_text('root ::= "a" | "b"\n')
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):
        assert main(_generate(model_dir, "--grammar", str(grammar), "--max-tokens", "1")) == 0
    assert capsys.readouterr().out in ("a\n", "b\n")
    assert "cut the output" not in caplog.text


def test_an_integer_cut_below_the_schemas_minimum_exits_1(model_dir, capsys, caplog):
    """`--json-schema '{"type":"integer","minimum":1000}' --max-tokens 1` printed `1` and exited 0: JSON that parses
    was taken as whole. One token holds at most two digits here, so the cut answer is below the minimum."""
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):
        assert main(_generate(model_dir, "--json-schema", BIG_INTEGER, "--max-tokens", "1")) == 1
    out = capsys.readouterr().out.strip()
    assert not (out.isdigit() and int(out) >= 1000), out
    assert "--max-tokens 1 cut the output before the constraint was complete" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="radiance.engine.cli"):  # 6 digits or more: whole when cut
        assert main(_generate(model_dir, "--json-schema", BIG_INTEGER, "--max-tokens", "6")) == 0
    assert json.loads(capsys.readouterr().out) >= 1000 and "cut the output" not in caplog.text


# ------------------------------------------------------------------------------ 2. no tokenizer: before the load


@pytest.fixture
def no_load(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LLM, "from_engine_config", load)


@pytest.mark.parametrize("keep_config, words", [
    (True, "tokenizer_config.json is here, but no vocabulary (none of tokenizer.json"),
    (False, "no tokenizer files (none of tokenizer.json"),
])
def test_a_model_without_a_tokenizer_is_refused_before_the_weights_load(no_load, capsys, tmp_path, tokenizer,
                                                                        keep_config, words):
    """Was refused after every weight and the KV cache (17.8 s on an MXFP4 copy of the embedded model), with
    transformers' "You need to have sentencepiece or tiktoken installed" for a tokenizer_config.json alone."""
    path = write_dir(str(tmp_path / "m"), dense_state_dict(), TINY)
    if keep_config:
        tokenizer.save_pretrained(path)
        (tmp_path / "m" / "tokenizer.json").unlink()  # a weights-only copy: the settings, no vocabulary
    assert main(_generate(path)) == 2
    err = _error_line(capsys)
    assert err.startswith("radiance generate: error: this model has no tokenizer: ") and words in err, err
    assert path in err and "sentencepiece" not in err


def test_the_load_reuses_the_tokenizer_generate_checked(model_dir, monkeypatch, capsys):
    """The check builds the tokenizer early, not twice: the checkpoint keeps it for the load."""
    import radiance.checkpoint.hf_reader as hf_reader

    built, load = [], hf_reader.load_tokenizer
    monkeypatch.setattr(hf_reader, "load_tokenizer", lambda path: built.append(path) or load(path))
    assert main(_generate(model_dir, "--max-tokens", "1")) == 0
    assert built == [model_dir]


# ------------------------------------------------------------------------------ 3. the KV cache's error in flags


def test_a_kv_cache_too_small_on_the_cpu_names_the_flag_and_the_field(model_dir, capsys):
    """Was "raise gpu_memory_utilization / cpu_kv_cache_bytes or lower max_num_batched_tokens": fields, and two
    that do not size the CPU's cache."""
    assert main(_generate(model_dir, "--cpu-kv-cache-bytes", "1")) == 2
    err = _error_line(capsys)
    assert "no memory left for the KV cache" in err and "raise --cpu-kv-cache-bytes (now 1)" in err, err
    assert "gpu" not in err and "batched" not in err
    with pytest.raises(ConfigError, match="in Python: cpu_kv_cache_bytes"):  # the LLM API's words
        LLM(model_dir, device="cpu", cpu_kv_cache_bytes=1)


def test_a_kv_cache_too_small_on_cuda_names_the_flags_and_the_fields(monkeypatch):
    """CUDA's budget: what the weights and the activation peak leave of gpu_memory_utilization (faked here)."""
    from radiance.engine import kv_cache

    model = types.SimpleNamespace(config=types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16,
                                                               attention_layer_ids=[0, 1]))
    monkeypatch.setattr(kv_cache, "_peak_activation_bytes", lambda *args: 1 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 29, 1 << 30))
    with pytest.raises(ConfigError) as info:
        kv_cache.num_kv_blocks(model, CacheConfig(gpu_memory_utilization=0.8),
                               SchedulerConfig(max_num_batched_tokens=4096), torch.device("cuda"), torch.float16)
    message = str(info.value)
    assert "raise --gpu-memory-utilization (now 0.8) or lower --max-num-batched-tokens (now 4096)" in message
    assert message.endswith("in Python: gpu_memory_utilization, max_num_batched_tokens") and "cpu" not in message
