"""The legacy completions `logprobs` object: OpenAI's top_logprobs holds "up to logprobs + 1 elements", the
chosen token's always among them (first, as vLLM writes it), so logprobs 0 still names the chosen token and a
chosen token outside the top k is not lost."""

from __future__ import annotations

import pytest

from radiance.engine.outputs import TokenLogprob
from radiance.server.logprobs_json import completion_logprobs


class _Tokenizer:
    """Token id i decodes to the letter 'a' + i."""

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [chr(ord("a") + i[0]) for i in ids]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_top_logprobs_name_the_chosen_token_first_then_the_top_k(k):
    alternatives = [(0, -0.1), (1, -0.9), (2, -1.5)][:k]
    entries = [
        TokenLogprob(0, -0.1, alternatives),  # the most likely token chosen: it is also among the top k
        TokenLogprob(4, -3.0, alternatives),  # sampled from the tail: not in the top k
    ]
    top = completion_logprobs(_Tokenizer(), entries, 0)["top_logprobs"]
    assert list(top[0]) == ["a", "b", "c"][:max(k, 1)]
    assert top[0]["a"] == -0.1
    assert list(top[1]) == ["e"] + ["a", "b", "c"][:k] and top[1]["e"] == -3.0


def test_an_unscored_echoed_first_token_keeps_null_top_logprobs():
    entries = [TokenLogprob(1, None, []), TokenLogprob(2, -0.7, [(3, -0.2)])]
    lp = completion_logprobs(_Tokenizer(), entries, 0)
    assert lp["token_logprobs"] == [None, -0.7]
    assert lp["top_logprobs"] == [None, {"c": -0.7, "d": -0.2}]
    assert lp["text_offset"] == [0, 1]


def test_an_alternative_spelled_like_the_chosen_token_keeps_the_chosen_one_s_logprob():
    class SameText(_Tokenizer):
        def batch_decode(self, ids):
            return ["x" if i[0] in (1, 2) else "y" for i in ids]

    top = completion_logprobs(SameText(), [TokenLogprob(1, -2.0, [(2, -0.5), (3, -1.0)])], 0)["top_logprobs"]
    assert top == [{"x": -2.0, "y": -1.0}]
