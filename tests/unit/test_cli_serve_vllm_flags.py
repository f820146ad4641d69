"""A `vllm serve` command line runs on `radiance serve` as it is: vLLM's flags that need no setting here are
accepted (tensor parallelism only at 1), and vLLM's names of the tool-call / reasoning parsers name ours."""

import argparse

import pytest

from radiance.config import ServerConfig
from radiance.errors import ConfigError
from radiance.server.cli import configs_from_args, register


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_a_vllm_command_line_parses_to_the_same_configs():
    vllm_line = ["m", "--enable-auto-tool-choice", "--tool-call-parser", "openai", "--reasoning-parser",
                 "openai_gptoss", "--trust-remote-code", "--disable-log-requests", "--tensor-parallel-size", "1",
                 "--generation-config", "vllm"]
    engine, server = configs_from_args(parse(vllm_line))
    assert (server.tool_call_parser, server.reasoning_parser, server.generation_config) == ("harmony", "harmony",
                                                                                          "vllm")
    plain_engine, plain = configs_from_args(parse(["m", "--tool-call-parser", "harmony", "--reasoning-parser",
                                                   "harmony", "--generation-config", "none"]))
    assert engine == plain_engine
    assert configs_from_args(parse(["m", "-tp", "1", "--no-enable-log-requests"]))[0] == configs_from_args(
        parse(["m"]))[0]


@pytest.mark.parametrize("vllm_name, ours", [("qwen3", "think"), ("deepseek_r1", "think"), ("glm45", "think"),
                                             ("gpt_oss", "harmony")])
def test_vllm_reasoning_parser_names(vllm_name, ours):
    assert ServerConfig(reasoning_parser=vllm_name).reasoning_parser == ours


def test_tensor_parallelism_above_one_is_refused_before_loading():
    with pytest.raises(ConfigError, match="tensor-parallel-size 2: radiance serves a model on one device"):
        configs_from_args(parse(["m", "--tensor-parallel-size", "2"]))


def test_an_unknown_parser_name_still_fails():
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="granite")


@pytest.mark.parametrize("flag, want", [('["*"]', ("*",)),
                                        ('["https://a.example", "http://localhost:3000"]',
                                         ("https://a.example", "http://localhost:3000"))])
def test_allowed_origins_take_vllms_json_list(flag, want):
    assert configs_from_args(parse(["m", "--allowed-origins", flag]))[1].allowed_origins == want


@pytest.mark.parametrize("flag", ['["*"', "[1, 2]"])
def test_a_broken_json_list_of_origins_is_refused(flag):
    with pytest.raises(ConfigError, match="allowed_origins"):
        ServerConfig(allowed_origins=(flag,))


@pytest.mark.parametrize("vllm_name", ["glm45", "glm47"])
def test_vllm_glm_tool_parser_names(vllm_name):
    """GLM-4.5 / 4.6 (glm45) and GLM-4.7 (glm47, the same markup without newlines) name radiance's glm45 parser."""
    assert ServerConfig(tool_call_parser=vllm_name).tool_call_parser == "glm45"
