"""/v1/responses message logprobs when the output holds a token its text leaves out (EOS let through by
ignore_eos or logit_bias, skipped by skip_special_tokens): the message's logprobs still spell its text, however
the engine's outputs group the tokens.

The tokenizer here decodes a special token alone to its text, as a Hugging Face tokenizer does by default, so a
count by the token's own text would give "<eos>" 5 characters; the route counts it as the text has it (none,
the shared LogprobCursor's textless tokens)."""

import json

import httpx
import pytest

from tests.server.fake_engine import BOS, EOS, ByteTokenizer, FakeEngine, serve_engine


class SpecialTextTokenizer(ByteTokenizer):
    """ByteTokenizer whose special tokens are listed (all_special_ids) and decode to their text unless skipped,
    as a Hugging Face tokenizer's batch_decode does by default."""

    @property
    def all_special_ids(self) -> list[int]:
        return [BOS, EOS, *range(258, 258 + len(self.special_tokens))]

    def batch_decode(self, batch, skip_special_tokens=False):
        return [self.decode(ids, skip_special_tokens) for ids in batch]


class GroupingEngine(FakeEngine):
    """Hands back every `every`-th output and the last (the real engine's newest output replaces those a busy
    consumer has not read yet): one output may carry several tokens, a special one among them."""

    def __init__(self):
        super().__init__(special_tokens=("<eos>",))
        self.tokenizer = SpecialTextTokenizer(("<eos>",))
        self.every = 1

    async def generate(self, request_id, prompt_token_ids, params):
        count = 0
        async for out in super().generate(request_id, prompt_token_ids, params):
            count += 1
            if out.finished or count % self.every == 0:
                yield out


@pytest.fixture(scope="module")
def served():
    engine = GroupingEngine()
    with serve_engine(engine) as url:
        yield url, engine


def _respond(url: str, stream: bool) -> tuple[dict, list[dict]]:
    body = {"model": "fake", "input": "hi", "stream": stream, "include": ["message.output_text.logprobs"],
            "top_logprobs": 1}
    if not stream:
        r = httpx.post(url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json(), []
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    return events[-1]["response"], events


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("every", [1, 2, 100])  # each token its own output, two at a time, all in the last
@pytest.mark.parametrize("reply", ["ab<eos>cd", "abcd<eos>", "<eos>abcd"])
def test_a_special_token_the_text_skips_takes_no_text_from_the_message(served, reply, every, stream):
    """The message is "abcd" and its logprobs are those of a, b, c, d: the <eos> (5 characters alone, none in
    the text) neither stands for text it did not make nor pushes the tokens that did out of the list."""
    url, engine = served
    engine.reply, engine.every = reply, every
    try:
        body, events = _respond(url, stream)
    finally:
        engine.reply, engine.every = None, 1
    assert body["usage"]["output_tokens"] == 5  # the <eos> was generated
    [message] = [item for item in body["output"] if item["type"] == "message"]
    part = message["content"][0]
    assert part["text"] == "abcd"
    assert [e["token"] for e in part["logprobs"]] == ["a", "b", "c", "d"], part["logprobs"]
    assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 1 for e in part["logprobs"])
    if stream:  # the deltas carry the same logprobs, each with its own text
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [e for d in deltas for e in d["logprobs"]] == part["logprobs"]
        for delta in deltas:
            assert "".join(e["token"] for e in delta["logprobs"]) == delta["delta"]
        [done] = [e for e in events if e["type"] == "response.output_text.done"]
        assert done["logprobs"] == part["logprobs"]


def test_without_skip_special_tokens_the_special_token_is_text_and_has_its_logprob(served):
    """skip_special_tokens false keeps "<eos>" in the text: then it is the message's text, with its logprob."""
    url, engine = served
    engine.reply, engine.every = "ab<eos>cd", 100
    try:
        r = httpx.post(url + "/v1/responses", json={"model": "fake", "input": "hi", "skip_special_tokens": False,
                                                    "include": ["message.output_text.logprobs"]}, timeout=30)
    finally:
        engine.reply, engine.every = None, 1
    assert r.status_code == 200, r.text
    part = r.json()["output"][0]["content"][0]
    assert part["text"] == "ab<eos>cd"
    assert [e["token"] for e in part["logprobs"]] == ["a", "b", "<eos>", "c", "d"]
