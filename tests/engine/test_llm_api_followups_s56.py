"""The offline API's divergences from vLLM's that the fifty-sixth session closed:
1. chat_template_content_format "openai" (content as OpenAI's list of parts) and vLLM's "auto" detection, which picks
   it for a template that loops over a message's content;
2. SamplingParams assignments go in any order: the rules between fields (greedy with n > 1, min_tokens <= max_tokens)
   are checked when the params are used (LLM.generate, the engine's add_request), with the constructor's message;
3. (bad words of several tokens already follow vLLM's rule: tests/engine/test_bad_words.py)
4. StructuredOutputsParams takes vLLM's options: disable_any_whitespace / disable_additional_properties (what the
   grammar does anyway), disable_fallback; whitespace_pattern and structural_tag are refused by name."""

from __future__ import annotations

import json

import pytest

from radiance import SamplingParams, StructuredOutputsParams
from radiance.engine.request_checks import SamplingParamsError
from radiance.errors import StructuredOutputError
from radiance.server.chat_template import content_format_of, render_chat, with_content_format

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
IDS = [5, 6, 7, 8]
# Qwen2-VL's shape: a string content printed as is, a list of parts looped over
PARTS = ("{% for message in messages %}<{{ message['role'] }}>"
         "{% if message['content'] is string %}S:{{ message['content'] }}"
         "{% else %}{% for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{% endfor %}{% endif %}"
         "|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
STRING = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": "fox"}]}]


@pytest.fixture(scope="module")
def text_llm(tiny_text_llm):
    return tiny_text_llm(max_num_seqs=4)


# ------------------------------------------------------------------ 1. chat_template_content_format


@pytest.mark.parametrize("template, expected", [
    (PARTS, "openai"),
    (STRING, "string"),
    # through a variable set from messages (a slice), and content read as an attribute through a filter
    ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content | selectattr('type') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    # a loop over something else's content: not a message's
    ("{% for t in tools %}{% for p in t['content'] %}{{ p }}{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
     "string"),
    # a tuple loop target over messages: vLLM's detection gives up, "string"
    ("{% for i, m in messages %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] ", "string"),  # does not parse: the default
])
def test_auto_detects_a_template_that_loops_over_content_as_vllm_does(template, expected):
    assert content_format_of(template, "auto") == expected
    assert content_format_of(template, "string") == "string" and content_format_of(template, "openai") == "openai"


def test_the_content_formats_shape_content_as_vllms_parser_does():
    messages = [{"role": "system", "content": "Be brief."}, *TWO_PARTS,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                        "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}]
    openai = with_content_format(messages, "openai")
    assert [m["content"] for m in openai] == [[{"type": "text", "text": "Be brief."}], TWO_PARTS[0]["content"], [],
                                              "a\nb"]  # a tool result as one string (vLLM's)
    assert openai[2]["tool_calls"] == messages[2]["tool_calls"] and messages[0]["content"] == "Be brief."  # copies
    string = with_content_format(messages, "string")
    assert [m["content"] for m in string] == ["Be brief.", "The quick\nfox", None, "a\nb"]
    for content_format in ("string", "openai"):
        with pytest.raises(ValueError, match=r"content parts must be \{'type': 'text', 'text': \.\.\.\} \(text only\)"):
            with_content_format([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                content_format)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of 'auto', 'string', 'openai'"):
        content_format_of(PARTS, "xml")


def test_chat_hands_a_part_looping_template_the_parts(text_llm):
    def prompt(messages, **kwargs):
        return text_llm.chat(messages, GREEDY, chat_template=PARTS, use_tqdm=False, **kwargs)[0].prompt

    # "auto" detected the loop: the parts reach it (it looped over the characters of the joined text before)
    assert prompt(TWO_PARTS) == prompt(TWO_PARTS, chat_template_content_format="openai") == \
        "<user>[text:The quick][text:fox]|<assistant>"
    assert prompt([{"role": "user", "content": "hi"}]) == "<user>[text:hi]|<assistant>"  # a string as one part
    assert prompt(TWO_PARTS, chat_template_content_format="string") == "<user>S:The quick\nfox|<assistant>"
    # a string template under "auto" keeps joining the parts
    out = text_llm.chat(TWO_PARTS, GREEDY, chat_template=STRING, use_tqdm=False)[0]
    assert out.prompt == "user: The quick\nfox\n"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        prompt(TWO_PARTS, chat_template_content_format="xml")
    with pytest.raises(ValueError, match="may not set 'chat_template_content_format'"):
        prompt(TWO_PARTS, chat_template_kwargs={"chat_template_content_format": "openai"})


def test_continue_final_message_with_content_as_parts(text_llm):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Well,"}, {"type": "text", "text": "so"}]}]
    text = text_llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                        chat_template=PARTS, chat_template_content_format="openai")
    assert text == "<user>[text:hi]|<assistant>[text:Well,][text:so"  # cut where the last part's text ends
    rendered = render_chat(PARTS, with_content_format(messages, "openai"), add_generation_prompt=False)
    assert rendered.startswith(text) and rendered != text


# ------------------------------------------------------------------ 2. assignments in any order


def test_assignments_go_in_any_order(llm_for_params):
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=2, ignore_eos=True)
    sp.temperature = 0  # refused at once before ("n must be 1 when using greedy sampling"), n = 1 not yet set
    sp.n = 1
    assert (sp.n, sp.temperature) == (1, 0)
    assert len(llm_for_params.generate([IDS], sp, use_tqdm=False)[0].outputs[0].token_ids) == 2
    sp.max_tokens = 1
    sp.min_tokens = 3  # above max_tokens until max_tokens is raised
    sp.max_tokens = 4
    assert (sp.min_tokens, sp.max_tokens) == (3, 4)


def test_the_rules_between_fields_are_checked_when_the_params_are_used(llm_for_params):
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=2)
    sp.temperature = 0.0
    with pytest.raises(SamplingParamsError, match=r"^n must be 1 when using greedy sampling, got 2$") as info:
        llm_for_params.generate([IDS], sp, use_tqdm=False)
    assert info.value.field == "n"
    assert not llm_for_params.engine.has_unfinished_requests()
    late = SamplingParams(max_tokens=2)
    late.min_tokens = 5
    message = r"^min_tokens must be at most max_tokens, got min_tokens 5 > max_tokens 2$"
    with pytest.raises(SamplingParamsError, match=message):
        llm_for_params.engine.add_request("late", IDS, late)
    with pytest.raises(SamplingParamsError, match=message):
        late.check_across_fields()
    assert "late" not in llm_for_params.engine.sequences
    twin = late.clone()  # vLLM's clone checks nothing either
    assert twin.min_tokens == 5 and twin is not late
    # the constructor checks them all at once, as before
    with pytest.raises(SamplingParamsError, match=r"^n must be 1 when using greedy sampling, got 2$"):
        SamplingParams(n=2, temperature=0.0)
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(max_tokens=2, min_tokens=5)
    with pytest.raises(SamplingParamsError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    # a field's own check stays at assignment, leaving the object as it was
    with pytest.raises(SamplingParamsError, match=r"temperature must be in \[0, 2\], got -"):
        late.temperature = -1.0
    assert late.temperature == 1.0


@pytest.fixture(scope="module")
def llm_for_params(tiny_llm):
    return tiny_llm(max_num_seqs=4)


# ------------------------------------------------------------------ 4. StructuredOutputsParams' options


def test_vllms_whitespace_and_properties_options_are_taken(text_llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True,
                                   disable_fallback=True)  # a TypeError before
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=spec)
    text = text_llm.generate("The", params, use_tqdm=False)[0].outputs[0].text
    # no free whitespace: exactly json.dumps' compact form, and no property beside "ok"
    assert text == json.dumps(json.loads(text)) and set(json.loads(text)) == {"ok"}, text
    with pytest.raises(StructuredOutputError, match="disable_any_whitespace must be true or false, got 'yes'"):
        StructuredOutputsParams(regex="a+", disable_any_whitespace="yes")


@pytest.mark.parametrize("option, value, message", [
    ("whitespace_pattern", r"[\n ]*", "whitespace_pattern is not supported: JSON is written with one space"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}',
     "structural_tag is not supported: use json, regex, choice, grammar or json_object"),
])
def test_options_that_cannot_be_honoured_are_refused_not_ignored(option, value, message):
    with pytest.raises(StructuredOutputError, match=message):
        StructuredOutputsParams(json={"type": "object"}, **{option: value})
