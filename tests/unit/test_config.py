"""Config dataclasses: validation, flat construction and the argparse glue."""

import argparse
import dataclasses

import pytest

from radiance import config
from radiance.cli import build_parser
from radiance.config import CacheConfig, EngineConfig, KernelConfig, ModelConfig, RunnerConfig, SchedulerConfig
from radiance.config_cli import add_engine_args, engine_config_from_args, field_help


def test_configs_are_frozen():
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.quantization = "none"  # type: ignore[misc]


@pytest.mark.parametrize("build, match", [
    (lambda: ModelConfig(quantization="int4"), "quantization"),
    (lambda: ModelConfig(rule="nearest"), "rule"),
    (lambda: ModelConfig(rule="none", quantization="mxfp4"), "only applies"),
    (lambda: CacheConfig(block_size=12), "power of two"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: KernelConfig(decode_band=512), "decode_band"),
    (lambda: RunnerConfig(prefill_graph_tokens=(256, -1)), "prefill_graph_tokens"),
])
def test_invalid_values_name_the_field(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_from_flat_routes_fields_and_rejects_unknown():
    cfg = EngineConfig.from_flat(max_num_seqs=3, quantization="none", decode_band=16, block_size=32)
    assert cfg.scheduler.max_num_seqs == 3 and cfg.model.quantization == "none"
    assert cfg.kernel.decode_band == 16 and cfg.cache.block_size == 32
    with pytest.raises(ValueError, match="unknown engine option.*max_seqs"):
        EngineConfig.from_flat(max_seqs=3)


def test_every_engine_field_is_a_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-seqs", "5", "--enforce-eager", "--enable-prefix-caching", "false",
                              "--ignore", "lm_head", "mlp", "--gpu-memory-utilization", "0.5"])
    cfg = engine_config_from_args(args, model="some/dir")
    assert cfg.scheduler.max_num_seqs == 5 and cfg.runner.enforce_eager is True
    assert cfg.cache.enable_prefix_caching is False and cfg.model.ignore == ("lm_head", "mlp")
    assert cfg.cache.gpu_memory_utilization == 0.5 and cfg.model.model == "some/dir"
    off = engine_config_from_args(parser.parse_args(["--prefill-graph-tokens", "0"]))
    assert off.runner.prefill_graph_tokens == (0,)  # 0: no prefill graphs (the runner keeps sizes > 0)
    chosen = engine_config_from_args(parser.parse_args(["--piecewise-graph-tokens", "32", "256"]))
    assert chosen.runner.piecewise_graph_tokens == (32, 256)
    flags = {a.dest for a in parser._actions}
    for sub in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(sub.default_factory):
            assert f.name in flags, f.name
    # untouched fields keep the dataclass defaults
    assert cfg.kernel == KernelConfig()


def _bare_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """`path --flag` for every option of the parser and its subcommands whose --help says nothing."""
    bare = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                bare += _bare_flags(sub, f"{path} {name}")
        elif action.option_strings and action.dest != "help" \
                and not (action.help or "").split("(default:")[0].strip():
            bare.append(f"{path} {action.option_strings[0]}")
    return bare


def test_every_cli_flag_explains_itself():
    """Every option of every `radiance` subcommand has --help text (config fields: their comment, trailing or
    the block above)."""
    assert _bare_flags(build_parser(), "radiance") == []


def test_field_help_reads_a_trailing_comment_or_the_block_above():
    @dataclasses.dataclass(frozen=True)
    class Example:
        plain: int = 1  # the trailing one
        # a reason that takes
        # two lines
        above: bool = False
        # a comment block, then a field with its own trailing comment: the trailing one wins
        both: str = "x"  # short
        bare: int = 0

    assert field_help(Example) == {"plain": "the trailing one", "above": "a reason that takes two lines",
                                   "both": "short"}


def test_prefill_graph_buckets_default_by_model_kind():
    auto = RunnerConfig()
    assert auto.prefill_graph_buckets(sparse_moe=False) == (128, 256, 512, 1024)
    # MoE models: their eager prefill stays host-bound to ~4k tokens
    assert auto.prefill_graph_buckets(sparse_moe=True) == (128, 256, 512, 1024, 1536, 2048, 3072, 4096)
    chosen = RunnerConfig(prefill_graph_tokens=(64, 512))
    assert chosen.prefill_graph_buckets(sparse_moe=True) == chosen.prefill_graph_buckets(sparse_moe=False) == (64, 512)
    assert RunnerConfig(prefill_graph_tokens=(0,)).prefill_graph_buckets(sparse_moe=True) == (0,)


def test_piecewise_graph_buckets_default_by_model_kind():
    auto = RunnerConfig()
    assert auto.piecewise_graph_buckets(sparse_moe=False) == (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
    assert auto.piecewise_graph_buckets(sparse_moe=True)[-4:] == (1536, 2048, 3072, 4096)
    # independent of the single-sequence prefill buckets
    assert RunnerConfig(prefill_graph_tokens=(0,)).piecewise_graph_buckets(sparse_moe=False) == auto.piecewise_graph_buckets(False)
    assert RunnerConfig(piecewise_graph_tokens=(48,)).piecewise_graph_buckets(sparse_moe=True) == (48,)
    with pytest.raises(ValueError, match="piecewise_graph_tokens"):
        RunnerConfig(piecewise_graph_tokens=(-1,))


def test_the_rule_names_of_the_options_are_the_codec_s():
    """config stays importable without torch (the CLI's --help), so it spells the MXFP4 rules itself."""
    from radiance import formats

    assert config.RULES == formats.RULES
