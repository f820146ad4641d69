"""A GGUF whose tokenizer cannot be built still loads (token-id prompts serve), and a text prompt's error names
why there is no tokenizer (the GGUF field, the file). Was: generate ended with a bare "this model has no
tokenizer" (the cause only in a warning scrolled away above), a chat prompt with a TypeError traceback, and the
server answered chat, responses, /tokenize and /detokenize with 500 "internal server error (AttributeError)"."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from radiance.cli import main
from radiance.engine.llm import LLM
from radiance.engine.sampling_params import SamplingParams
from radiance.errors import ConfigError
from tests.checkpoint.test_gguf_chat_templates import spm_tokenizer
from tests.checkpoint.test_gguf_metadata import VOCAB, write_gguf

FIELD = "tokenizer.ggml.eos_token_id"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def broken_gguf(tmp_path, template: bool = True) -> str:
    """An eos id beyond the token list: transformers cannot build the tokenizer, the weights load."""
    extra = {FIELD: VOCAB + 4, **({"tokenizer.chat_template": TEMPLATE} if template else {})}
    return write_gguf(tmp_path / "broken.gguf", metadata=spm_tokenizer(**extra))


@pytest.fixture(scope="module")
def broken_llm(tmp_path_factory):
    path = broken_gguf(tmp_path_factory.mktemp("gguf"))
    return path, LLM(model=path, device="cpu", num_gpu_blocks_override=16)


def _names_the_cause(message: str, path: str) -> bool:
    return message.startswith("this model has no tokenizer: ") and FIELD in message and path in message


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "no-template"])
def test_generate_ends_with_the_cause(tmp_path, capsys, template):
    path = broken_gguf(tmp_path, template)
    assert main(["generate", "hi", "--model", path, "--device", "cpu", "--max-tokens", "2",
                 "--num-gpu-blocks-override", "16"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("radiance generate: error: ")
    assert _names_the_cause(last.removeprefix("radiance generate: error: "), path), last


def test_the_llm_api_names_the_cause_and_serves_token_ids(broken_llm):
    path, llm = broken_llm
    for call in (lambda: llm.generate("hi"), lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(ConfigError) as info:
            call()
        assert _names_the_cause(str(info.value), path), info.value
    out = llm.generate([1, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 2


def _post(url: str, route: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + route, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", CHAT, "messages"),
    ("/v1/chat/completions", dict(CHAT, stream=True), "messages"),
    ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 2}, "input"),
    ("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": "fake", "prompt": [1, 5], "max_tokens": 2, "logprobs": 1}, "logprobs"),
    ("/tokenize", {"model": "fake", "prompt": "hi"}, None),
    ("/detokenize", {"model": "fake", "tokens": [1, 5]}, "tokens"),
])
def test_the_server_answers_text_requests_with_a_400_naming_the_cause(broken_llm, route, body, param):
    from radiance.engine.async_engine import AsyncLLMEngine
    from tests.server.fake_engine import serve_engine

    path, llm = broken_llm
    with serve_engine(AsyncLLMEngine(engine=llm.engine)) as url:
        status, answer = _post(url, route, body)
        assert status == 400, answer
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert _names_the_cause(error["message"], path), error
        # ... and token-id completions still serve
        status, answer = _post(url, "/v1/completions", {"model": "fake", "prompt": [1, 5, 6], "max_tokens": 2,
                                                          "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
