"""The offline API as a vLLM user writes it: LLM(...)'s vLLM arguments, prompt dicts, SamplingParams' fields and
bad values, RequestOutput's fields, chat's arguments, and an LLM that stays usable after a failed call."""

from __future__ import annotations

import pytest
import torch

from radiance import LLM, SamplingParams
from radiance.engine import llm as llm_module
from radiance.engine.request_checks import SamplingParamsError
from radiance.errors import ConfigError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm():
    # vLLM's spellings of the defaults, accepted (trust_remote_code, tensor_parallel_size 1 change nothing); a
    # short context, so that the truncation test prefills little past it
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, dtype="auto", quantization=None,
               trust_remote_code=True, tensor_parallel_size=1, max_logprobs=20)


def text_of(outputs) -> str:
    return outputs[0].outputs[0].text


# ------------------------------------------------------------------ SamplingParams


def test_unknown_sampling_field_is_a_value_error_naming_it():
    with pytest.raises(SamplingParamsError, match="'temprature'"):
        SamplingParams(temprature=0.5)  # a bare TypeError before
    with pytest.raises(ValueError, match="guided_decoding.*structured_output="):
        SamplingParams(guided_decoding=None)


@pytest.mark.parametrize("bias", [{5: "x"}, [1, 2], {5: True}])
def test_malformed_logit_bias_is_named(bias):
    with pytest.raises(SamplingParamsError, match="logit_bias"):  # "could not convert string to float" before
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("ids", [[-1], [True]])
def test_stop_token_ids_must_be_non_negative_integers(ids):
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):  # matched nothing / stopped at token 1
        SamplingParams(stop_token_ids=ids)


def test_clone_is_an_equal_copy():
    params = SamplingParams(max_tokens=3, stop=["x"])
    assert params.clone() == params


def test_detokenize_false_returns_ids_without_text(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0, detokenize=False))[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 3
    with pytest.raises(SamplingParamsError, match="stop strings need detokenize"):
        SamplingParams(stop=["."], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = list(range(100, 130))
    out = llm.generate(prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=10))[0]
    assert out.prompt_token_ids == prompt[-10:]
    context = llm.engine.max_model_len
    long_prompt = [5] * (context + 10)
    kept = llm.generate(long_prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))[0]
    assert len(kept.prompt_token_ids) == context - 2
    with pytest.raises(SamplingParamsError, match=f"truncate_prompt_tokens {context} .*max_tokens 2"):
        llm.generate(long_prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=context))


# ------------------------------------------------------------------ generate


def test_vllm_prompt_dicts(llm):
    expected = text_of(llm.generate("Hello", GREEDY))
    assert text_of(llm.generate({"prompt": "Hello"}, GREEDY)) == expected
    ids = llm.get_tokenizer()("Hello").input_ids
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Hello", "cache_salt": "tenant"}], GREEDY)
    assert [o.outputs[0].text for o in both] == [expected, expected]
    assert both[0].prompt is None and both[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {}}, GREEDY)


def test_a_tuple_of_sampling_params_is_one_per_prompt(llm):
    outs = llm.generate(("a", "b"), (SamplingParams(max_tokens=1), SamplingParams(max_tokens=3)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]


def test_request_output_fields(llm):
    outs = llm.generate(["a", "b"], SamplingParams(n=2, max_tokens=2, seed=1))
    assert len({o.request_id for o in outs}) == 2 and all(o.request_id.isdigit() for o in outs)
    for out in outs:
        assert out.finished and all(choice.finished() for choice in out.outputs)
        assert out.metrics.first_token is not None and out.metrics.last_token >= out.metrics.first_token


def test_max_logprobs_caps_a_request(llm):
    with pytest.raises(SamplingParamsError, match="logprobs is 21, more than max_logprobs 20"):
        llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=21))
    assert not llm.engine.has_unfinished_requests()


def test_failed_or_interrupted_call_leaves_the_llm_usable(llm, monkeypatch):
    expected = text_of(llm.generate("Hi", GREEDY))
    step = llm.engine.step
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        calls = []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:
                raise error
            return step()

        monkeypatch.setattr(llm.engine, "step", failing_step)
        with pytest.raises(type(error)):
            llm.generate(["a", "b"], SamplingParams(max_tokens=8, ignore_eos=True))
        assert not llm.engine.sequences  # aborted: the next call does not decode them on
        monkeypatch.setattr(llm.engine, "step", step)
        assert text_of(llm.generate("Hi", GREEDY)) == expected


# ------------------------------------------------------------------ chat


def test_chat_template_and_its_kwargs_are_used(llm):
    template = "{{ greeting }}{{ messages[-1]['content'] }}"
    out = llm.chat(HI, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "Say "})[0]
    assert out.prompt_token_ids == llm.get_tokenizer()("Say Hi", add_special_tokens=False).input_ids


def test_template_gets_the_bos_token(llm):
    prompt = llm.apply_chat_template(HI, chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert prompt == llm.get_tokenizer().bos_token + "Hi"


def test_continue_final_message_ends_inside_the_message(llm):
    messages = [*HI, {"role": "assistant", "content": "Hel"}]
    out = llm.chat(messages, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("assistant\nHel")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(messages, GREEDY, continue_final_message=True)


def test_text_content_parts_are_joined(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(joined, GREEDY)[0].prompt_token_ids
    with pytest.raises(ValueError, match="text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)


# ------------------------------------------------------------------ LLM(...) arguments


class RecordingEngine:
    """Stands in for LLMEngine: keeps the config LLM built, loads nothing."""

    def __init__(self, config, checkpoint=None):
        self.config = config


@pytest.mark.parametrize("dtype, name", [("half", "float16"), ("float", "float32"), ("auto", None),
                                         (torch.bfloat16, "bfloat16")])
def test_vllm_dtype_names(monkeypatch, dtype, name):
    monkeypatch.setattr(llm_module, "LLMEngine", RecordingEngine)
    assert LLM(dtype=dtype).engine.config.model.dtype == name


def test_vllm_engine_arguments(monkeypatch):
    monkeypatch.setattr(llm_module, "LLMEngine", RecordingEngine)
    config = LLM(seed=None, quantization=None, trust_remote_code=True, disable_log_stats=True,
                 tensor_parallel_size=1, tokenizer=None).engine.config
    assert isinstance(config.model.seed, int) and config.model.quantization == "auto"
    assert LLM(model="org/name", revision="v2").engine.config.model.model == "org/name@v2"


# each named, with why (before: "unknown engine option(s): tensor_parallel_size", or no vLLM names for dtype)
@pytest.mark.parametrize("kwargs, message", [({"tensor_parallel_size": 2}, "tensor_parallel_size must be 1"),
                                             ({"tokenizer": "other/tok"}, "tokenizer 'other/tok': .* a separate"),
                                             ({"dtype": "bf16"}, "dtype must be one of .*vLLM's half"),
                                             ({"revision": "v2"}, "revision 'v2' applies to a .*Hub id"),
                                             ({"max_logprobs": -3}, "max_logprobs must be .* or -1")])
def test_unservable_vllm_arguments_are_named(monkeypatch, kwargs, message):
    monkeypatch.setattr(llm_module, "LLMEngine", RecordingEngine)
    with pytest.raises(ConfigError, match=message):
        LLM(**kwargs)
