"""A GGUF's named chat templates (tokenizer.chat_template.tool_use, ... as llama.cpp's converter writes a
tokenizer_config.json list of {name, template}), its tokenizer metadata and end-of-generation ids."""

import pytest

from radiance.checkpoint import convert_checkpoint, open_checkpoint
from radiance.config import ConvertConfig
from radiance.errors import CheckpointError
from tests.checkpoint.test_gguf_metadata import VOCAB, write_gguf

DEFAULT = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
TOOL_USE = "TOOLS {{ tools | length }}:{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]


def spm_tokenizer(**extra) -> dict:
    """A llama (SentencePiece) vocabulary of VOCAB tokens, as the write_gguf metadata."""
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "i", "▁hi"] + [f"w{i}" for i in range(VOCAB - 7)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [-1.0] * (VOCAB - 3),
            "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (VOCAB - 3),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra}


def named_templates(**templates) -> dict:
    """The metadata gguf-py's add_chat_template writes for a list of {name, template}."""
    meta = {f"tokenizer.chat_template.{name}": text for name, text in templates.items() if name != "default"}
    if len(meta):
        meta["tokenizer.chat_templates"] = [name for name in templates if name != "default"]
    if "default" in templates:
        meta["tokenizer.chat_template"] = templates["default"]
    return meta


def test_named_templates_are_read_beside_the_default(tmp_path):
    """Was: only tokenizer.chat_template was read; tool_use was lost."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        **spm_tokenizer(), **named_templates(default=DEFAULT, tool_use=TOOL_USE)}))
    assert ckpt.chat_templates == {"default": DEFAULT, "tool_use": TOOL_USE}
    assert ckpt.chat_template == DEFAULT


def test_the_tokenizer_takes_tool_use_for_a_request_with_tools(tmp_path):
    """transformers' structure for a tokenizer_config.json list: {name: template} on the tokenizer."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        **spm_tokenizer(), **named_templates(default=DEFAULT, tool_use=TOOL_USE)}))
    tok = ckpt.tokenizer()
    assert tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False) == "TOOLS 1:[hi]"
    assert tok.apply_chat_template(CHAT, tokenize=False) == "<hi>"


def test_one_template_stays_a_string(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={**spm_tokenizer(),
                                                                     **named_templates(default=DEFAULT)}))
    assert ckpt.chat_templates == {"default": DEFAULT} and ckpt.tokenizer().chat_template == DEFAULT


def test_named_templates_only_take_the_first_as_the_hf_path_does(tmp_path):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={**spm_tokenizer(),
                                                                     **named_templates(tool_use=TOOL_USE)}))
    assert ckpt.chat_template == TOOL_USE and ckpt.chat_templates == {"tool_use": TOOL_USE}


def test_convert_keeps_every_named_template(tmp_path):
    """Was: the converted tokenizer carried the default template only."""
    from transformers import AutoTokenizer

    src = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        **spm_tokenizer(), **named_templates(default=DEFAULT, tool_use=TOOL_USE)}))
    convert_checkpoint(src, str(tmp_path / "out"), ConvertConfig(format="mxfp4"), progress=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.chat_template == {"default": DEFAULT, "tool_use": TOOL_USE}
    assert open_checkpoint(str(tmp_path / "out")).chat_template == DEFAULT


def test_a_file_without_tokenizer_metadata_says_so(tmp_path):
    """Was: transformers' "Cannot build a tokenizer from a GGUF file stating tokenizer None"."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf"))
    assert not ckpt.has_tokenizer
    with pytest.raises(CheckpointError, match="the GGUF file holds no tokenizer: no tokenizer.ggml"):
        ckpt.tokenizer()
    assert open_checkpoint(write_gguf(tmp_path / "t.gguf", metadata=spm_tokenizer())).has_tokenizer


def test_llama31_eom_ends_generation(tmp_path):
    """Llama 3.1 ends a built-in tool call with <|eom_id|>: was not an end-of-generation id."""
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(**{
        "tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6})))
    assert ckpt.eos_token_ids == [2, 5, 6]


@pytest.mark.parametrize("add_bos, first", [(True, [1]), (False, [])])
def test_add_bos_token_reaches_the_tokenizer(tmp_path, add_bos, first):
    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata=spm_tokenizer(**{
        "tokenizer.ggml.add_bos_token": add_bos})))
    ids = ckpt.tokenizer()("hi").input_ids
    assert ids[:len(first)] == first and (add_bos or ids[0] != 1)
    assert ckpt.config["bos_token_id"] == 1 and ckpt.config["eos_token_id"] == 2


def test_inspect_lists_the_named_templates(tmp_path):
    from radiance.checkpoint.inspect import inspect_lines

    ckpt = open_checkpoint(write_gguf(tmp_path / "m.gguf", metadata={
        **spm_tokenizer(), **named_templates(default=DEFAULT, tool_use=TOOL_USE)}))
    line = next(line for line in inspect_lines(ckpt) if line.startswith("generation"))
    assert line.endswith("chat template yes (named: tool_use)"), line
