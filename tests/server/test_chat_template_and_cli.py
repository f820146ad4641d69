"""Chat template rendering (sandbox, HF helpers) and the `serve` command line."""

import argparse
import datetime

import pytest

from radiance.config import ServerConfig
from radiance.errors import ConfigError
from radiance.server.chat_template import (TemplateError, load_template, prompt_opens_thinking, render_chat,
                                           template_features)
from radiance.server.cli import configs_from_args, register

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# the shape of Qwen3's template: tools as JSON lines, tool calls printed with tojson, optional thinking
QWEN_LIKE = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def test_chatml_render():
    text = render_chat(CHATML, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not render_chat(CHATML, [{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith("assistant\n")


def test_the_developer_role_is_the_system_prompt_unless_the_template_knows_it():
    """OpenAI's developer role: rendered as system by a template without one (SmolLM2's wrote a developer turn and
    added its default system prompt above it); a template that has the role (gpt-oss's) gets it as sent."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(CHATML, messages) == render_chat(CHATML, [dict(messages[0], role="system"), messages[1]])
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }};{% endfor %}"
    assert render_chat(knows, messages) == "D:Be brief.;Hi;"


def test_tools_and_tool_call_arguments_reach_the_template_as_data():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = render_chat(QWEN_LIKE, messages, tools=tools)
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '"arguments": {"city": "Zürich"}' in text  # a mapping printed by tojson, non-ASCII kept
    assert "<tool_response>sunny</tool_response>" in text
    # SmolLM2's template concatenates content: the null content of a calls-only turn (what OpenAI clients
    # send back) renders as ""
    concat = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    assert "<|im_start|>assistant\n<|im_end|>" in render_chat(concat, messages)
    closed = render_chat(QWEN_LIKE, messages[:1], enable_thinking=False)
    assert not prompt_opens_thinking(closed)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")


def test_template_helpers_and_errors():
    today = render_chat("{{ strftime_now('%Y') }}", [])
    assert today == str(datetime.datetime.now().year)
    with pytest.raises(TemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="unsafe"):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ConfigError, match="does not parse"):
        render_chat("{% for %}", [])


def test_template_features_pick_parsers(tmp_path):
    assert template_features(QWEN_LIKE) == {"qwen3_coder": False, "glm45": False, "hermes": True, "llama3_json": False,
                                            "think": True, "harmony": False, "mistral": False, "mistral_think": False}
    assert template_features("<tool_call><function=x>")["qwen3_coder"]
    assert template_features(None) == {"qwen3_coder": False, "glm45": False, "hermes": False, "llama3_json": False,
                                       "think": False, "harmony": False, "mistral": False, "mistral_think": False}
    assert template_features("<tool_call>{{ n }}<arg_key>{{ k }}</arg_key>")["glm45"]
    assert template_features('{{ "[TOOL_CALLS] [" }}')["mistral"]
    llama = '<|start_header_id|>assistant<|end_header_id|>{"name": "f", "parameters": {}}'
    assert template_features(llama)["llama3_json"] and template_features("<|python_tag|>")["llama3_json"]
    llama4 = '<|header_start|>user<|header_end|>Respond in the format {"name": function name, "parameters": ...}'
    assert template_features(llama4)["llama3_json"] and not template_features("<|header_start|>")["llama3_json"]
    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    assert load_template(str(path)) == CHATML
    assert load_template(CHATML) == CHATML
    with pytest.raises(ConfigError, match="not found"):
        load_template(str(tmp_path / "missing.jinja"))


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_serve_flags_reach_both_configs():
    args = parse(["serve", "model.gguf", "--served-model-name", "main", "alias", "--api-key", "k", "--port", "9001",
                  "--host", "0.0.0.0", "--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization",
                  "0.5", "--quantization", "mxfp4", "--device", "cpu", "--enforce-eager", "--decode-band", "32",
                  "--tool-call-parser", "hermes"])
    engine, server = configs_from_args(args)
    assert engine.model.model == "model.gguf" and engine.model.max_model_len == 256
    assert engine.model.quantization == "mxfp4" and engine.model.device == "cpu"
    assert engine.scheduler.max_num_seqs == 4 and engine.cache.gpu_memory_utilization == 0.5
    assert engine.runner.enforce_eager is True and engine.kernel.decode_band == 32
    assert server == ServerConfig(host="0.0.0.0", port=9001, served_model_name=("main", "alias"), api_key="k",
                                  tool_call_parser="hermes")


def test_serve_defaults_and_bad_values():
    engine, server = configs_from_args(parse(["serve"]))
    assert engine.model.model is None and server.port == 8000
    with pytest.raises(ConfigError, match="--tool-call-parser must be one of"):
        configs_from_args(parse(["serve", "--tool-call-parser", "pythonic"]))
    with pytest.raises(ConfigError, match="--max-num-seqs must be positive, got 0"):
        configs_from_args(parse(["serve", "--max-num-seqs", "0"]))
    with pytest.raises(ConfigError, match="two models"):
        configs_from_args(parse(["serve", "a.gguf", "--model", "b.gguf"]))


def test_serve_with_a_missing_model_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    from tests.server.fake_engine import free_port

    missing = tmp_path / "missing.gguf"
    proc = subprocess.run([sys.executable, "-m", "radiance.cli", "serve", str(missing), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "radiance serve: error:" in proc.stderr and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_refuses_a_max_model_len_past_the_context_before_it_listens(tmp_path):
    """The model's config is read before the port is bound: the refusal is one line, exit 2, and no server ever
    announced itself (the "loading ...; the API at ..." line comes after the bind)."""
    import subprocess
    import sys

    from tests.engine.conftest import tiny_hf_model
    from tests.server.fake_engine import free_port

    tiny_hf_model("llama3").save_pretrained(tmp_path)  # max_position_embeddings 512
    proc = subprocess.run([sys.executable, "-m", "radiance.cli", "serve", str(tmp_path), "--max-model-len", "4096",
                           "--port", str(free_port()), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "max_model_len 4096 exceeds the model's context of 512 tokens" in proc.stderr
    assert "answers /health" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("tool_flag,reasoning_flag,template,want", [
    ("auto", "auto", "<tool_call><function=f> <think>", ("qwen3_coder", "think")),
    ("auto", "auto", "<tool_call>{}</tool_call>", ("hermes", None)),
    ("auto", "auto", '<|start_header_id|>{"name": "f", "parameters": {}}', ("llama3_json", None)),
    ("auto", "auto", CHATML, (None, None)),
    ("auto", "auto", '[INST]{{ "[TOOL_CALLS][" }}', ("mistral", None)),
    ("mistral", "auto", CHATML, ("mistral", None)),
    ("auto", "auto", '[INST]{{ "[TOOL_CALLS]" }} [THINK] <think>', ("mistral", "mistral")),  # Magistral
    ("auto", "mistral", CHATML, (None, "mistral")),
    ("hermes", "none", "<tool_call><function=f> <think>", ("hermes", None)),
    ("none", "think", CHATML, (None, "think")),
])
def test_parsers_default_from_the_template_and_flags_override(tool_flag, reasoning_flag, template, want):
    from radiance.server.state import ServerState
    from tests.server.fake_engine import FakeEngine

    state = ServerState(ServerConfig(tool_call_parser=tool_flag, reasoning_parser=reasoning_flag), lambda: None)
    state.attach(FakeEngine(chat_template=template))
    assert (state.tool_parser_name, state.reasoning_parser_name) == want
    assert state.served_names == ("fake-model",)
