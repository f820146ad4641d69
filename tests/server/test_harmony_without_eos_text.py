"""The engine leaves an EOS token's text out of the output (vLLM's rule, unless include_stop_str_in_output),
and gpt-oss's <|call|> / <|return|> are EOS tokens: the harmony parsers read an output that stopped without
its ending markup as they read one with it (a call whose body is whole is a call; only max_tokens cuts one)."""

from types import SimpleNamespace

import pytest

from radiance.engine.outputs import StepOutput
from radiance.server.chat_choice import ChoiceStream

CALL_ID, RETURN_ID, WORD_ID = 200012, 200002, 17
MARKUP = {CALL_ID: "<|call|>", RETURN_ID: "<|return|>", WORD_ID: "Paris"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'


class MarkupTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(MARKUP[i] for i in ids if not (skip_special_tokens and MARKUP[i].startswith("<|")))


def _stream(tools=TOOLS) -> ChoiceStream:
    state = SimpleNamespace(tokenizer=MarkupTokenizer(), reasoning_parser_name="harmony",
                            tool_parser_name="harmony")
    return ChoiceStream(state, 0, tools, opens_thinking=False)


def _finished(text: str, last_id: int, reason: str = "stop") -> StepOutput:
    return StepOutput("r", [1], text, [WORD_ID, last_id], None, reason, True)


def test_a_call_ended_by_the_hidden_call_token_is_whole():
    choice = _stream()
    delta, _ = choice.step(_finished(CALL, CALL_ID))
    [call] = delta["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city":"Paris"}')
    assert not choice.cut_call_ids and choice.finish_reason() == "tool_calls"


def test_a_call_cut_by_max_tokens_stays_cut():
    choice = _stream()
    delta, _ = choice.step(_finished(CALL, WORD_ID, reason="length"))
    assert len(choice.cut_call_ids) == len(delta.get("tool_calls", [])) == 1


@pytest.mark.parametrize("text", ["<|channel|>final<|message|>Sunny.", "<|channel|>final<|message|>Sunny.<|return|>"])
def test_the_final_answer_reads_the_same_with_or_without_the_eos_text(text):
    """With include_stop_str_in_output the engine keeps <|return|> in the text: it is not fed twice."""
    delta, _ = _stream(tools=None).step(_finished(text, RETURN_ID))
    assert delta == {"content": "Sunny."}


def test_a_stop_string_end_adds_no_markup():
    """finish_reason stop by a stop string: the last token is plain text, nothing is added."""
    delta, _ = _stream(tools=None).step(_finished("<|channel|>final<|message|>Sunny. Paris", WORD_ID))
    assert delta == {"content": "Sunny. Paris"}
