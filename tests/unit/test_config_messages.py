"""Every validation message of radiance.config names the field, what it takes (values, range or rule) and the value
given (`got ...`), so that the CLI, which words the fields as flags (config_cli.in_flag_words) and adds a value only
to a message that says none, reads as one clean line. Before, several said no value at all ("generation_config must
be auto or none") or only a number the CLI appended, never a string or a list."""

from __future__ import annotations

import ast
import inspect

import pytest

import radiance.config.convert as config_convert
import radiance.config.engine as config_engine
import radiance.config.server as config_server
from radiance.cli import main
from radiance.config import (CacheConfig, ConvertConfig, KernelConfig, ModelConfig, RunnerConfig, SchedulerConfig,
                             ServerConfig, SpeculativeConfig)
from radiance.errors import ConfigError

MESSAGES = [
    (lambda: ModelConfig(rule="none", quantization="mxfp4"),
     "rule 'none' only applies to quantization 'nvfp4', got quantization 'mxfp4' (with quantization nvfp4, rule "
     "none serves NVFP4 weights, a checkpoint's or 16-bit ones quantized at load, dequantized as W4A16)"),
    (lambda: ModelConfig(max_model_len=0), "max_model_len must be positive, got 0"),
    (lambda: ModelConfig(quantize_lm_head=True),
     "quantize_lm_head needs quantization mxfp4 or nvfp4 (it quantizes a 16-bit head at load), got quantization "
     "'auto'"),
    (lambda: ModelConfig(lm_head_format="mxfp4x2"),
     "lm_head_format 'mxfp4x2' applies to a quantized lm_head, got quantize_lm_head off: add quantize_lm_head"),
    (lambda: ModelConfig(lm_head_format="mxfp4x2", quantize_lm_head=True, quantization="nvfp4", rule="none"),
     "lm_head_format 'mxfp4x2' quantizes to MXFP4: it needs a rule other than 'none' ('mse', 'noclip' or 'ocp'), "
     "got rule 'none'"),
    (lambda: CacheConfig(block_size=12), "block_size must be a power of two, got 12"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (lambda: CacheConfig(cpu_kv_cache_bytes=0), "cpu_kv_cache_bytes must be positive, got 0"),
    (lambda: CacheConfig(num_gpu_blocks_override=-3), "num_gpu_blocks_override must be positive, got -3"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be positive, got 0"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-1), "max_num_batched_tokens must be positive, got -1"),
    (lambda: KernelConfig(decode_band=512), "decode_band must be in [1, 256], got 512"),
    (lambda: KernelConfig(activations="int8"), "activations must be one of ('fp8', 'bf16'), got 'int8'"),
    (lambda: KernelConfig(numerics_check_every=0), "numerics_check_every must be positive, got 0"),
    (lambda: RunnerConfig(cuda_graph_max_batch=0), "cuda_graph_max_batch must be positive, got 0"),
    (lambda: RunnerConfig(prefill_graph_tokens=(256, -1)),
     "prefill_graph_tokens must be token counts, integers >= 0 (0 alone: no prefill graphs), got (256, -1)"),
    (lambda: RunnerConfig(piecewise_graph_tokens=(1.5,)),
     "piecewise_graph_tokens must be token counts, integers >= 0 (0 alone: no piecewise graphs), got (1.5,)"),
    (lambda: SpeculativeConfig(ngram_draft_tokens=33), "ngram_draft_tokens must be in [0, 32], got 33"),
    (lambda: SpeculativeConfig(ngram_min=5, ngram_max=2),
     "ngram_min must be in [1, ngram_max], got ngram_min 5 with ngram_max 2"),
    (lambda: ServerConfig(host=" "), "host must be non-empty (0.0.0.0 listens on every interface), got ' '"),
    (lambda: ServerConfig(port=70000), "port must be in [0, 65535], got 70000"),
    (lambda: ServerConfig(max_logprobs=21), "max_logprobs must be in [0, 20], got 21"),
    (lambda: ServerConfig(max_n=0), "max_n must be positive, got 0"),
    (lambda: ServerConfig(generation_config="foo"),
     "generation_config must be one of ('auto', 'none', 'vllm'), got 'foo'"),
    (lambda: ServerConfig(responses_store=-1), "responses_store must be >= 0, got -1"),
    (lambda: ServerConfig(responses_store_bytes=-1), "responses_store_bytes must be >= 0, got -1"),
    (lambda: ServerConfig(served_model_name=("a", "")), "served_model_name entries must be non-empty, got ('a', '')"),
    (lambda: ServerConfig(ssl_certfile="c.pem"),
     "HTTPS needs both ssl_keyfile and ssl_certfile (or neither, for HTTP), got ssl_certfile without ssl_keyfile"),
    (lambda: ServerConfig(allowed_origins=("",)), "allowed_origins entries must be non-empty, got ('',)"),
    (lambda: ServerConfig(api_key=""), "api_key must be non-empty when given, got ''"),
    (lambda: ConvertConfig(dense_dtype="float32"), "dense_dtype must be one of ('bfloat16', 'float16'), got 'float32'"),
    (lambda: ConvertConfig(max_shard_bytes=0), "max_shard_bytes must be positive, got 0"),
    (lambda: ConvertConfig(chunk_rows=0), "chunk_rows must be positive, got 0"),
    # a value of the wrong type from Python (the CLI's parser converts its own): a TypeError in a comparison before
    (lambda: ModelConfig(max_model_len="4096"), "max_model_len must be an integer or None, got '4096'"),
    (lambda: CacheConfig(block_size="16"), "block_size must be an integer, got '16'"),
    (lambda: SchedulerConfig(max_num_seqs=True), "max_num_seqs must be an integer, got True"),
    (lambda: CacheConfig(enable_prefix_caching="false"), "enable_prefix_caching must be true or false, got 'false'"),
    (lambda: ModelConfig(ignore=("lm_head", 3)), "ignore must be a tuple of values each a string, got ('lm_head', 3)"),
    (lambda: KernelConfig(decode_band=16.0), "decode_band must be an integer, got 16.0"),
]


def test_a_list_for_a_tuple_field_is_taken_as_the_tuple():
    config = ModelConfig(ignore=["lm_head"])
    assert config.ignore == ("lm_head",) and hash(config)  # still a frozen, hashable config
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1  # an int is a number


def test_numpy_values_and_paths_are_taken_as_plain_values():
    """A review's case: LLM(model=Path(...)), max_model_len=np.int64(8), enforce_eager=1 ran before the type check
    and were refused by its first form; they are stored as the plain Python values."""
    import pathlib

    import numpy as np

    model = ModelConfig(model=pathlib.Path("/models/m"), max_model_len=np.int64(8), ignore=[np.str_("x")])
    assert (model.model, model.max_model_len, model.ignore) == ("/models/m", 8, ("x",))
    assert type(model.max_model_len) is int
    cache = CacheConfig(gpu_memory_utilization=np.float32(0.5), enable_prefix_caching=np.False_)
    assert (cache.gpu_memory_utilization, cache.enable_prefix_caching) == (0.5, False)
    assert type(cache.gpu_memory_utilization) is float and type(cache.enable_prefix_caching) is bool
    assert CacheConfig(enable_prefix_caching=1).enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching must be true or false, got 2"):
        CacheConfig(enable_prefix_caching=2)


def test_none_from_flat_keyword_arguments_is_the_default():
    """vLLM's LLM(enable_prefix_caching=None, max_num_seqs=None) mean its defaults (None turned caching off before,
    then was refused by the type check)."""
    from radiance.config import EngineConfig

    config = EngineConfig.from_flat(enable_prefix_caching=None, max_num_seqs=None, max_model_len=None)
    assert config.cache.enable_prefix_caching is True and config.scheduler.max_num_seqs == 64
    assert config.model.max_model_len is None


def test_a_nested_config_of_the_wrong_class_is_named():
    from radiance.config import EngineConfig

    with pytest.raises(ConfigError, match="^model must be a ModelConfig, got 'x'$"):
        EngineConfig(model="x")


@pytest.mark.parametrize("build, message", MESSAGES)
def test_each_message_names_the_field_what_it_takes_and_the_value_given(build, message):
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value) == message


@pytest.mark.parametrize("key, fault", [
    ("sk-1\n", "got a key of 5 characters whose character 5 is U+000A (a control character)"),
    ("cl\u00e9", "got a key of 3 characters whose character 3 is U+00E9"),
    (" sk-1", "got a key of 5 characters with a leading or trailing space"),
])
def test_a_bad_api_key_is_described_not_repeated(key, fault):
    """A key is a secret: the message says what is wrong with it, never the key itself (it may reach a log)."""
    with pytest.raises(ConfigError) as err:
        ServerConfig(api_key=key)
    assert str(err.value).startswith("api_key must be printable ASCII") and str(err.value).endswith(fault)
    assert key.strip() not in str(err.value)


def _check_messages() -> list[tuple[str, int, str]]:
    """(module, line, source) of the message of every check(...) call in the radiance.config package."""
    messages = []
    for module in (config_engine, config_server, config_convert):
        source = inspect.getsource(module)
        calls = [node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check"]
        messages += [(module.__name__, call.lineno, ast.get_source_segment(source, call.args[1])) for call in calls]
    return messages


# messages that quote the value given in words of their own
QUOTE_THE_VALUE_OTHERWISE = ("more than once", "is no JSON list of strings")


def test_every_check_in_config_says_the_value_given():
    """A new check without `got ...` fails here, not in a user's terminal."""
    messages = _check_messages()
    assert len(messages) >= 35
    silent = [(module, line, text) for module, line, text in messages
              if "got " not in text and not any(words in text for words in QUOTE_THE_VALUE_OTHERWISE)]
    assert silent == []


@pytest.mark.parametrize("argv, error", [
    (["serve", "--generation-config", "foo"], "--generation-config must be one of ('auto', 'none', 'vllm'), got 'foo'"),
    (["generate", "hi", "--max-model-len", "0"], "--max-model-len must be positive, got 0"),
    (["generate", "hi", "--ngram-min", "5", "--ngram-max", "2"],
     "--ngram-min must be in [1, --ngram-max], got --ngram-min 5 with --ngram-max 2"),
    (["generate", "hi", "--prefill-graph-tokens", "-1"],
     "--prefill-graph-tokens must be token counts, integers >= 0 (0 alone: no prefill graphs), got (-1,)"),
    (["generate", "hi", "--quantize-lm-head"], "--quantize-lm-head needs --quantization mxfp4 or nvfp4 (it "
     "quantizes a 16-bit head at load), got --quantization 'auto'"),
    (["serve", "--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile (or neither, for "
     "HTTP), got --ssl-keyfile without --ssl-certfile"),
    (["convert", "embedded", "/nonexistent/out", "--dense-dtype", "float32"], "--dense-dtype must be one of "
     "('bfloat16', 'float16'), got 'float32'"),
])
def test_the_cli_says_each_as_one_line_in_flag_words(monkeypatch, capsys, argv, error):
    import radiance.engine
    from radiance.engine.llm import LLM

    monkeypatch.setattr(LLM, "from_engine_config", lambda *a, **k: pytest.fail("loaded despite a bad flag"))
    monkeypatch.setattr(radiance.engine, "AsyncLLMEngine", lambda *a, **k: pytest.fail("loaded despite a bad flag"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"radiance {argv[0]}: error: {error}"
