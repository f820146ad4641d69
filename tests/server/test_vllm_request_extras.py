"""vLLM's request extras that change the output: allowed_token_ids, truncate_prompt_tokens, add_special_tokens,
cache_salt, include_reasoning and bad_words are applied; logits_processors, structural_tag and prompt_embeds are
400s naming the field (they were logged as ignored and answered as if not sent)."""

import pytest

from tests.server.fake_engine import BOS, FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http

CONTEXT = 64


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=CONTEXT)
    with serve_engine(engine) as url:
        yield url, engine


@pytest.fixture(scope="module")
def thinking_server():
    engine = FakeEngine(max_model_len=2048)
    with serve_engine(engine, reasoning_parser="think") as url:
        yield url, engine


def _chat(server, content="SAY:hi", **fields):
    return http(server, "POST", "/v1/chat/completions",
                {"model": "fake", "messages": [{"role": "user", "content": content}], **fields}, key=None)


def _complete(server, prompt="SAY:hi", **fields):
    return http(server, "POST", "/v1/completions", {"model": "fake", "prompt": prompt, **fields}, key=None)


def _sent(server):
    """(prompt ids, SamplingParams) of the newest engine request."""
    return server[1].requests[-1][1:]


# ---------------------------------------------------------------- allowed_token_ids


@pytest.mark.parametrize("send", [_chat, _complete])
def test_allowed_token_ids_reach_the_engine(server, send):
    r = send(server, allowed_token_ids=[3, 1, 2, 2])
    assert r.status_code == 200, r.text
    assert _sent(server)[1].allowed_token_ids == (1, 2, 3)
    assert send(server).status_code == 200
    assert _sent(server)[1].allowed_token_ids is None


@pytest.mark.parametrize("send", [_chat, _complete])
@pytest.mark.parametrize("bad", [[], [258 + 1000], [-1], [1.5], ["1"], [True], 5])
def test_a_bad_allowed_token_ids_is_a_400(server, send, bad):
    r = send(server, allowed_token_ids=bad)
    check_error_shape(r, 400, None)
    assert r.json()["error"]["param"] in ("allowed_token_ids", "allowed_token_ids[0]"), r.text  # an item: its index


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_completion_keeps_the_last_tokens(server):
    r = _complete(server, prompt="abcdefSAY:hi", truncate_prompt_tokens=5, echo=True, add_special_tokens=False)
    assert r.status_code == 200, r.text
    assert _sent(server)[0] == list(b"AY:hi")
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["text"].startswith("AY:hi")  # echo gives the prompt the model saw
    ids = list(b"xxSAY:ok")  # token ids are cut the same way
    assert _complete(server, prompt=ids, truncate_prompt_tokens=6).status_code == 200
    assert _sent(server)[0] == ids[-6:]
    assert _complete(server, prompt="SAY:hi", truncate_prompt_tokens=40).status_code == 200  # shorter: kept whole
    assert _sent(server)[0] == [BOS] + list(b"SAY:hi")


def test_truncation_answers_a_prompt_longer_than_the_context(server):
    long = "x" * 200 + "SAY:hi"
    check_error_shape(_complete(server, prompt=long), 400, "prompt")  # without it: the context check
    r = _complete(server, prompt=long, truncate_prompt_tokens=20, max_tokens=8)
    assert r.status_code == 200, r.text
    assert len(_sent(server)[0]) == 20
    # -1: as many as leave room for max_tokens (chat without one: room for a single token)
    assert _complete(server, prompt=long, truncate_prompt_tokens=-1, max_tokens=8).status_code == 200
    assert len(_sent(server)[0]) == CONTEXT - 8
    r = _chat(server, content=long, truncate_prompt_tokens=-1)
    assert r.status_code == 200, r.text
    assert len(_sent(server)[0]) == CONTEXT - 1 and _sent(server)[1].max_tokens == 1


def test_chat_truncates_the_rendered_prompt_on_the_left(server):
    r = _chat(server, content="y" * 100 + "SAY:hi", truncate_prompt_tokens=30)
    assert r.status_code == 200, r.text
    ids = _sent(server)[0]
    assert len(ids) == 30 and bytes(ids).endswith(b"SAY:hi<|end|><|assistant|>")
    assert r.json()["usage"]["prompt_tokens"] == 30


@pytest.mark.parametrize("send", [_chat, _complete])
@pytest.mark.parametrize("bad", [0, -2, 1.5, "3", True])
def test_a_bad_truncate_prompt_tokens_is_a_400(server, send, bad):
    check_error_shape(send(server, truncate_prompt_tokens=bad), 400, "truncate_prompt_tokens")


@pytest.mark.parametrize("send", [_chat, _complete])
def test_truncating_to_more_than_the_room_for_the_prompt_is_a_400(server, send):
    r = send(server, truncate_prompt_tokens=CONTEXT - 7, max_tokens=8)  # vLLM's max_input_tokens: 64 - 8
    check_error_shape(r, 400, "truncate_prompt_tokens")
    assert f"max_model_len {CONTEXT} - max_tokens 8 = {CONTEXT - 8}" in r.json()["error"]["message"]
    assert send(server, truncate_prompt_tokens=CONTEXT - 8, max_tokens=8).status_code == 200


# ---------------------------------------------------------------- add_special_tokens


def test_completion_add_special_tokens(server):
    assert _complete(server).status_code == 200
    assert _sent(server)[0][0] == BOS  # vLLM's default for completions: the tokenizer's BOS
    assert _complete(server, add_special_tokens=False).status_code == 200  # a prompt already templated
    assert _sent(server)[0] == list(b"SAY:hi")
    check_error_shape(_complete(server, add_special_tokens="no"), 400, "add_special_tokens")


def test_chat_add_special_tokens(server):
    assert _chat(server).status_code == 200
    assert _sent(server)[0][0] != BOS  # vLLM's default for chat: the template writes its own
    assert _chat(server, add_special_tokens=True).status_code == 200
    assert _sent(server)[0][0] == BOS


# ---------------------------------------------------------------- cache_salt, include_reasoning


@pytest.mark.parametrize("send", [_chat, _complete])
def test_cache_salt_reaches_the_engine(server, send):
    assert send(server, cache_salt="s3cr3t").status_code == 200
    assert _sent(server)[1].cache_salt == "s3cr3t"
    for bad in ("", 5):
        check_error_shape(send(server, cache_salt=bad), 400, "cache_salt")


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_reasoning(thinking_server, stream):
    content = "SAY:<think>hmm</think>Paris"

    def answer(**fields):
        r = _chat(thinking_server, content, stream=stream, **fields)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["message"]
        import json
        message = {}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for key, value in choice["delta"].items():
                        if isinstance(value, str):
                            message[key] = message.get(key, "") + value
        return message

    assert answer()["reasoning_content"] == "hmm"
    message = answer(include_reasoning=False)
    assert message["content"] == "Paris"
    assert "reasoning_content" not in message and "reasoning" not in message


# ---------------------------------------------------------------- bad_words


@pytest.mark.parametrize("send", [_chat, _complete])
def test_bad_words_reach_the_engine(server, send):
    r = send(server, bad_words=["the", " cat"])
    assert r.status_code == 200, r.text
    params = _sent(server)[1]
    assert params.bad_words == ("the", " cat") and params.adjusts_logits
    assert send(server, bad_words=[]).status_code == 200  # vLLM's default: nothing banned
    assert _sent(server)[1].bad_words == ()
    assert send(server).status_code == 200
    assert _sent(server)[1].bad_words == ()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("send", [_chat, _complete])
@pytest.mark.parametrize("bad", ["the", [""], [3], ["ok", None], {"a": 1}, [f"w{i}" for i in range(129)],
                                 ["a\ud800"]])
def test_bad_bad_words_are_a_400_naming_the_field(server, send, stream, bad):
    """Before a stream starts (tokenized and checked as the engine will), not an error event inside it."""
    r = send(server, bad_words=bad, stream=stream)
    check_error_shape(r, 400, None)
    assert r.json()["error"]["param"] in ("bad_words", "bad_words[0]", "bad_words[1]"), r.text


def test_bad_words_need_a_tokenizer():
    engine = FakeEngine()
    engine.tokenizer = None
    with serve_engine(engine) as url:
        r = _complete((url, engine), prompt=[104, 105], bad_words=["x"])
        check_error_shape(r, 400, "bad_words")


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize("send", [_chat, _complete])
@pytest.mark.parametrize("field, value", [("logits_processors", ["my.Proc"]),
                                          ("structural_tag", '{"type": "structural_tag"}')])
def test_unsupported_extras_are_refused_by_name(server, send, field, value):
    r = send(server, **{field: value})
    check_error_shape(r, 400, field)
    assert "not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("send", [_chat, _complete])
def test_empty_unsupported_lists_ask_for_nothing(server, send):
    assert send(server, logits_processors=[]).status_code == 200


def test_prompt_embeds_is_refused_by_name(server):
    check_error_shape(_complete(server, prompt_embeds="AAAA"), 400, "prompt_embeds")


def test_harmless_extras_are_still_ignored(server):
    r = _chat(server, request_id="mine", vllm_xargs={"a": 1}, length_penalty=2.0, guided_decoding_backend="x",
              spaces_between_special_tokens=False, kv_transfer_params={}, mm_processor_kwargs={})
    assert r.status_code == 200, r.text


def test_documents_reach_the_template():
    template = "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}{{ messages[-1].content }}"
    engine = FakeEngine(chat_template=template)
    with serve_engine(engine) as url:
        r = _chat((url, engine), documents=[{"title": "Doc1", "text": "x"}])
        assert r.status_code == 200, r.text
        assert bytes(engine.requests[-1][1]).startswith(b"[Doc1]SAY:hi")
        check_error_shape(_chat((url, engine), documents=[{"title": 1}]), 400, None)


def test_tokenize_add_special_tokens_defaults_by_input_and_is_honoured():
    """/tokenize counts what the completion routes send: a prompt gets BOS unless asked not to, messages get none
    unless asked (the template writes its own), as vLLM's tokenize requests default."""
    engine = FakeEngine()
    with serve_engine(engine) as url:
        def tokens(**body):
            r = http((url, engine), "POST", "/tokenize", {"model": "fake", **body}, key=None)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert tokens(prompt="hi") == [BOS, 104, 105] and tokens(prompt="hi", add_special_tokens=False) == [104, 105]
        messages = [{"role": "user", "content": "hi"}]
        plain = tokens(messages=messages)
        assert plain[0] != BOS and tokens(messages=messages, add_special_tokens=True) == [BOS] + plain
