"""Server follow-ups of the fifty-fourth session: a streamed chat answer's chunks in vLLM's order.

1. The role chunks come with the engine's first output, not when the request arrives: a client's first chunk
   (`vllm bench serve`'s time to first token) then times the prefill.
2. Every choice's role chunk, then every choice's echo (were interleaved per choice).
3. The last delta carries the finish reason (was a separate empty-delta chunk, which a benchmark timing every chunk
   with a choice counted as one more inter-token gap).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import httpx

from tests.server.fake_engine import FakeEngine, serve_engine


class GatedEngine(FakeEngine):
    """Holds every request before its first output until `gate` is set (a long prefill)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    async def generate(self, request_id, prompt_token_ids, params):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out


def _read_events(url: str, body: dict, events: queue.Queue) -> None:
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.put(line[len("data: "):])
    events.put(None)


def test_the_role_chunk_comes_with_the_first_output_not_before_the_prefill():
    engine = GatedEngine()
    body = {"model": "fake", "stream": True, "n": 2, "echo": False,
            "messages": [{"role": "user", "content": "SAY:hi"}]}
    with serve_engine(engine) as url:
        events: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_read_events, args=(url, body, events), daemon=True)
        reader.start()
        try:
            first = events.get(timeout=1.0)
        except queue.Empty:
            first = None
        assert first is None, f"a chunk came before the engine's first output: {first}"
        engine.gate.set()
        got = []
        while (event := events.get(timeout=30)) is not None:
            got.append(event)
        reader.join(timeout=10)
    chunks = [json.loads(e) for e in got if e != "[DONE]"]
    # both choices' role chunks first, then their content
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    for index in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"][0]["index"] == index)
        assert text == "hi"
    assert got[-1] == "[DONE]"


def _chunks(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_role_chunks_then_echoes_then_answers_ending_with_the_finish_reason():
    body = {"model": "fake", "stream": True, "n": 2, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 32,
            "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "SAY:ab"}]}
    with serve_engine(FakeEngine()) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choices = [c["choices"][0] for c in _chunks(r) if c["choices"]]
    assert [(c["index"], c["delta"]) for c in choices[:4]] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
        (0, {"content": "SAY:ab"}), (1, {"content": "SAY:ab"})]
    for index in (0, 1):
        answer = [c for c in choices[4:] if c["index"] == index]
        assert [c["delta"].get("content") for c in answer] == ["a", "b"]  # one token a chunk, no empty last one
        assert [c["finish_reason"] for c in answer] == [None, "stop"]


# ---------------------------------------------------------------- request fields, from a first-time user's audit

def test_an_explicit_null_max_tokens_on_completions_is_the_rest_of_the_context():
    """vLLM's: the 16 default applies only when the field is absent; a null asks for the rest of the context."""
    engine = FakeEngine(max_model_len=64)
    with serve_engine(engine) as url:
        base = {"model": "fake", "prompt": "SAY:hi"}
        assert httpx.post(f"{url}/v1/completions", json=base, timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={**base, "max_tokens": None}, timeout=30).status_code == 200
        long_prompt = {**base, "prompt": list(range(60))}  # 60 tokens of 64: no room for the default 16
        null = httpx.post(f"{url}/v1/completions", json={**long_prompt, "max_tokens": None}, timeout=30)
        absent = httpx.post(f"{url}/v1/completions", json=long_prompt, timeout=30)
    assert [params.max_tokens for _, _, params in engine.requests] == [16, 64 - 7, 4]
    assert null.status_code == 200, null.text
    assert absent.status_code == 400 and "16" in absent.json()["error"]["message"]


def test_text_like_content_parts_are_read_as_text():
    """input_text / output_text (the Responses API's) and an assistant's refusal are text to vLLM too; an image is
    still refused by name."""
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "SAY:"}, {"type": "text", "text": "x"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"},
                                                  {"type": "output_text", "text": "yes"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "SAY:ok"}]}]
    engine = FakeEngine()
    with serve_engine(engine) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "fake", "messages": messages}, timeout=30)
        image = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={"model": "fake", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    prompt = engine.tokenizer.decode(engine.requests[0][1])
    assert "<|user|>SAY:\nx<|end|><|assistant|>no\nyes<|end|><|user|>SAY:ok" in prompt
    assert image.status_code == 400 and "'image_url'" in image.json()["error"]["message"]


def test_sampling_errors_name_their_field_and_a_non_utf8_body_says_so():
    with serve_engine(FakeEngine()) as url:
        chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        bad_stop = httpx.post(f"{url}/v1/chat/completions", json={**chat, "stop_token_ids": [-1]}, timeout=30)
        bad_min = httpx.post(f"{url}/v1/completions", timeout=30,
                             json={"model": "fake", "prompt": "hi", "max_tokens": 2, "min_tokens": 5})
        not_utf8 = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "\xff"}', timeout=30,
                              headers={"Content-Type": "application/json"})
        alive = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
    assert (bad_stop.status_code, bad_stop.json()["error"]["param"]) == (400, "stop_token_ids")
    assert (bad_min.status_code, bad_min.json()["error"]["param"]) == (400, "min_tokens")
    assert not_utf8.status_code == 400 and "UTF-8" in not_utf8.json()["error"]["message"]
    assert alive.status_code == 200


def test_a_tool_call_in_the_finishing_output_gets_the_openai_client_s_done_event():
    """The finish reason rides on the last delta, except after tool calls: the openai client's stream helper fires
    `tool_calls.function.arguments.done` only for calls seen before the chunk with the finish reason."""
    import openai

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    engine = FakeEngine(max_model_len=2048)
    engine.reply = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    with serve_engine(engine, tool_call_parser="hermes") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with client.chat.completions.stream(model="fake", messages=[{"role": "user", "content": "w?"}],
                                            tools=tools) as stream:
            done = [(e.index, e.arguments) for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert done == [(0, '{"city": "Paris"}'), (1, '{"city": "Rome"}')]


def test_a_content_part_type_that_is_not_a_string_is_a_400():
    with serve_engine(FakeEngine()) as url:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{url}{path}", timeout=30, json={"model": "fake", "messages": [
                {"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]})
            assert r.status_code == 400 and "must be a string" in r.json()["error"]["message"], (path, r.text)
