"""A model's named "tool_use" chat template (tokenizer_config.json's list of {name, template}, or
additional_chat_templates/tool_use.jinja as transformers saves it, or a GGUF's tokenizer.chat_template.tool_use)
renders requests that carry tools, as transformers' apply_chat_template picks it; only "default" was read."""

import json

import openai
import pytest

from radiance.checkpoint.hf_config import chat_template, chat_templates
from tests.engine.conftest import TINY_TOKENIZER_VOCAB, tiny_byte_bpe_tokenizer, tiny_hf_model
from tests.server.fake_engine import TEMPLATE, FakeEngine, serve_engine

DEFAULT = "{% for m in messages %}{{ m.content }}{% endfor %}[default]"
TOOL_USE = "{% for m in messages %}{{ m.content }}{% endfor %}[tool_use: {{ tools | length }}]"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_a_tokenizer_config_list_gives_every_named_template(tmp_path):
    config = {"chat_template": [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_templates(str(tmp_path)) == {"default": DEFAULT, "tool_use": TOOL_USE}
    assert chat_template(str(tmp_path)) == DEFAULT


def test_transformers_saved_templates_are_read(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(DEFAULT)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE)
    assert chat_templates(str(tmp_path)) == {"default": DEFAULT, "tool_use": TOOL_USE}


@pytest.fixture(scope="module")
def tool_template_dir(tmp_path_factory):
    """A tiny Llama saved by transformers with a default and a tool_use template."""
    path = tmp_path_factory.mktemp("tool-template")
    tokenizer = tiny_byte_bpe_tokenizer()
    tokenizer.chat_template = {"default": DEFAULT, "tool_use": TOOL_USE}
    model = tiny_hf_model("llama3", vocab_size=TINY_TOKENIZER_VOCAB)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm_with_tool_template(tool_template_dir):
    from radiance import LLM

    return LLM(str(tool_template_dir), device="cpu", dtype="float32")


def test_the_llm_renders_tools_with_the_tool_use_template(llm_with_tool_template):
    messages = [{"role": "user", "content": "hi"}]
    assert llm_with_tool_template.engine.chat_templates == {"default": DEFAULT, "tool_use": TOOL_USE}
    assert llm_with_tool_template.apply_chat_template(messages) == "hi[default]"
    assert llm_with_tool_template.apply_chat_template(messages, tools=TOOLS) == "hi[tool_use: 1]"


TOOL_TEMPLATE = TEMPLATE.replace("<|assistant|>", "<|user|>SAY:from tool_use<|end|><|assistant|>")


@pytest.mark.parametrize("override, expected", [(None, "from tool_use"), (TEMPLATE, "from default")])
def test_the_server_renders_requests_with_tools_through_the_tool_use_template(override, expected):
    """With --chat-template every named template gives way to the given one."""
    engine = FakeEngine()
    engine.chat_templates = {"default": TEMPLATE, "tool_use": TOOL_TEMPLATE}
    with serve_engine(engine, chat_template=override) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        ask = [{"role": "user", "content": "SAY:from default"}]
        plain = client.chat.completions.create(model="fake", messages=ask)
        with_tools = client.chat.completions.create(model="fake", messages=ask, tools=TOOLS)
    assert plain.choices[0].message.content == "from default"
    assert with_tools.choices[0].message.content == expected



def test_convert_keeps_the_named_templates(tool_template_dir, tmp_path):
    from radiance.checkpoint import convert_checkpoint, open_checkpoint
    from radiance.config import ConvertConfig

    convert_checkpoint(str(tool_template_dir), str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    assert open_checkpoint(str(tmp_path / "out")).chat_templates == {"default": DEFAULT, "tool_use": TOOL_USE}
