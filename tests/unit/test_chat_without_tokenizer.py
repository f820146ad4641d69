"""A chat request on a model whose tokenizer could not be built (a broken GGUF) and that has no chat template: the
400 names the tokenizer's absence and its cause, the real reason, where it said "no chat template" first."""

import pytest

from tests.checkpoint.test_no_tokenizer_reason import CHAT, FIELD, _post, broken_gguf


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", CHAT, "messages"),
    ("/v1/responses", {"model": "fake", "input": "hi", "max_output_tokens": 2}, "input"),
])
def test_a_chat_without_tokenizer_nor_template_names_the_tokenizer_cause(tmp_path, route, body, param):
    from radiance.engine.async_engine import AsyncLLMEngine
    from radiance.engine.llm import LLM
    from tests.server.fake_engine import serve_engine

    path = broken_gguf(tmp_path, template=False)
    llm = LLM(model=path, device="cpu", num_gpu_blocks_override=16)
    assert llm.engine.chat_template is None and llm.tokenizer is None
    with serve_engine(AsyncLLMEngine(engine=llm.engine)) as url:
        status, answer = _post(url, route, body)
    error = answer["error"]
    assert status == 400 and error["param"] == param, answer
    assert error["message"].startswith("this model has no tokenizer: ") and FIELD in error["message"], error
    assert path in error["message"] and "template" not in error["message"].replace(path, ""), error
