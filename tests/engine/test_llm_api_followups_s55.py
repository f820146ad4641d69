"""The offline API's divergences from vLLM's that the fifty-fifth session's audit found, resolved:
1. SamplingParams is mutable as vLLM's (`sp.max_tokens = 64`), an assigned value checked as the constructor checks
   it; the engine keeps its own copy of a request's parameters;
2. LLM.chat's outputs carry the rendered template text as their prompt;
3. n > 1 with greedy sampling is refused (vLLM's _verify_greedy_sampling), a 400 naming n from the server;
4. vLLM's field names structured_outputs (StructuredOutputsParams), output_kind, spaces_between_special_tokens;
5. generate's priority and tokenization_kwargs, chat's tokenization_kwargs, chat_template_content_format and
   mm_processor_kwargs (they reached the template as variables);
6. stop_token_ids outside the vocabulary are refused (a 400 from the server);
7. seed -1 is no seed;
8. vLLM's normalisations: logprobs=True, de-duplicated stop_token_ids, a tiny temperature raised to 0.01, none
   above 2; sampling_type and all_stop_token_ids;
9. CompletionOutput's positional order is vLLM's; LLM.llm_engine; chat takes a tuple of conversations."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest

import radiance
from radiance import SamplingParams
from radiance.cli import main
from radiance.engine.outputs import CompletionOutput
from radiance.engine.request_checks import RequestError, SamplingParamsError
from radiance.engine.structured_output import StructuredOutput

IDS = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
            "{% if tokenization_kwargs is defined or chat_template_content_format is defined %}LEAK{% endif %}")
HI = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_num_seqs=4)


@pytest.fixture(scope="module")
def text_llm(tiny_text_llm):
    return tiny_text_llm(max_num_seqs=4)


def chat(llm, messages=HI, **kwargs):
    kwargs.setdefault("sampling_params", GREEDY)
    return llm.chat(messages, chat_template=TEMPLATE, use_tqdm=False, **kwargs)


# ------------------------------------------------------------------ 1. mutable SamplingParams


def test_vllms_example_assigns_to_the_default_sampling_params(llm):
    """vllm examples/offline_inference/basic/generate.py: FrozenInstanceError before."""
    sp = llm.get_default_sampling_params()
    sp.max_tokens = 3
    sp.temperature = 0.8
    sp.ignore_eos = True
    assert (sp.max_tokens, sp.temperature) == (3, 0.8)
    out = llm.generate([IDS], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("name, bad", [("max_tokens", 0), ("top_p", 0.0), ("temperature", -1.0), ("stop", [""]),
                                       ("n", 0), ("logit_bias", {5: 200}), ("seed", 1.5), ("ignore_eos", "no")])
def test_an_assigned_value_is_checked_as_the_constructor_checks_it(name, bad):
    with pytest.raises(SamplingParamsError) as constructed:
        SamplingParams(**{name: bad})
    sp = SamplingParams(max_tokens=5)
    before = copy.copy(sp)
    with pytest.raises(SamplingParamsError) as assigned:
        setattr(sp, name, bad)
    assert str(assigned.value) == str(constructed.value)
    assert sp == before  # a refused value leaves the object as it was


def test_an_assigned_value_is_normalised_as_the_constructor_normalises_it():
    sp = SamplingParams()
    sp.stop = "END"
    sp.stop_token_ids = [7, 7, 3]
    sp.logit_bias = {5: 1}
    sp.seed = -1
    sp.logprobs = True
    assert (sp.stop, sp.stop_token_ids, sp.logit_bias, sp.seed, sp.logprobs) == (("END",), (7, 3), ((5, 1.0),),
                                                                                   None, 1)
    spec = radiance.StructuredOutputsParams(regex="a+")
    sp.structured_outputs = spec  # vLLM's name
    assert sp.structured_output is spec and sp.structured_outputs is spec


def test_a_field_that_does_not_exist_cannot_be_assigned():
    sp = SamplingParams()
    with pytest.raises(SamplingParamsError, match="unknown field 'temprature'"):
        sp.temprature = 0.5  # a typo, silently kept, would sample at the old temperature


def test_clone_is_an_independent_mutable_copy():
    sp = SamplingParams(max_tokens=5, stop=["x"])
    twin = sp.clone()
    twin.max_tokens = 9
    twin.n = 2
    assert (sp.max_tokens, sp.n) == (5, 1) and (twin.max_tokens, twin.n) == (9, 2)
    with pytest.raises(SamplingParamsError):
        twin.top_k = -5  # the copy's assignments are checked too


def test_the_engine_keeps_its_own_copy_of_a_requests_parameters(llm):
    """The caller reuses its object for the next request: the request already added keeps what it was given."""
    engine = llm.engine
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("copy-a", IDS, sp)
    sp.max_tokens = 1
    engine.add_request("copy-b", IDS, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
    assert done == {"copy-a": 4, "copy-b": 1}


# ------------------------------------------------------------------ 2. chat's prompt text


def test_chat_outputs_carry_the_rendered_template_text(text_llm):
    out = chat(text_llm)[0]
    text = text_llm.apply_chat_template(HI, chat_template=TEMPLATE)
    assert out.prompt == text == "user: The quick brown fox\nassistant:"  # None before
    assert out.prompt_token_ids == text_llm.tokenizer(text, add_special_tokens=False).input_ids


# ------------------------------------------------------------------ 3. n > 1 with greedy sampling


def test_n_above_one_with_greedy_sampling_is_refused_naming_n(llm):
    with pytest.raises(SamplingParamsError, match=r"^n must be 1 when using greedy sampling, got 2$") as info:
        SamplingParams(n=2, temperature=0.0)
    assert info.value.field == "n"
    sp = SamplingParams(n=3, temperature=0.7)
    sp.temperature = 0.0  # assignment checks the field alone: the params' use checks the pair (s56)
    with pytest.raises(SamplingParamsError, match="n must be 1 when using greedy sampling, got 3"):
        llm.generate([IDS], sp, use_tqdm=False)
    assert len(llm.generate([IDS], SamplingParams(n=2, max_tokens=2, seed=1), use_tqdm=False)[0].outputs) == 2


@pytest.fixture(scope="module")
def fake_server():
    from tests.server.fake_engine import FakeEngine, serve_engine

    engine = FakeEngine(max_model_len=512)
    with serve_engine(engine, max_n=4) as url:
        yield url, engine


def _post(server, path, body):
    from tests.server.test_api_fake_engine import http

    return http(server, "POST", path, {"model": "fake", **body}, key=None)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:hi"}]}),
    ("/v1/completions", {"prompt": "SAY:hi"}),
])
def test_the_server_answers_greedy_n_above_one_with_a_400_naming_n(fake_server, path, body):
    r = _post(fake_server, path, {**body, "n": 2, "temperature": 0})
    assert r.status_code == 400, r.text  # was served: two identical choices
    error = r.json()["error"]
    assert error["param"] == "n" and error["message"] == "n must be 1 when using greedy sampling, got 2"
    assert _post(fake_server, path, {**body, "n": 2, "temperature": 0.5}).status_code == 200


# ------------------------------------------------------------------ 4. vLLM's field names


def test_vllms_structured_outputs_field_and_class_are_taken(text_llm):
    assert radiance.StructuredOutputsParams is StructuredOutput
    assert radiance.engine.StructuredOutputsParams is StructuredOutput
    spec = radiance.StructuredOutputsParams(choice=["fox", "dog"], json_object=None)  # vLLM's default of json_object
    sp = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=spec)
    assert sp.structured_output is spec and sp.structured_outputs is spec
    out = text_llm.generate("The quick brown", sp, use_tqdm=False)[0].outputs[0]
    assert out.text in ("fox", "dog")
    # vLLM's name wins, so that dataclasses.replace (which passes the old structured_output too) takes it
    other = StructuredOutput(regex="x")
    assert SamplingParams(structured_outputs=spec, structured_output=other).structured_output is spec
    assert replace(sp, structured_outputs=other).structured_output is other
    assert replace(sp, structured_outputs=None).structured_output is None


def test_logprobs_false_is_none_beside_the_sampled_token():
    """vLLM's: False reads as 0 (True as 1); it was refused as "must be an integer"."""
    sp = SamplingParams(logprobs=False, prompt_logprobs=True)
    assert (sp.logprobs, sp.prompt_logprobs) == (0, 1) and type(sp.logprobs) is int


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA", "FINAL_ONLY", 2])
def test_output_kind_is_taken_and_ignored(llm, kind):
    from radiance.engine.sampling_params import RequestOutputKind

    assert radiance.RequestOutputKind is RequestOutputKind
    kind = RequestOutputKind[kind] if isinstance(kind, str) else kind  # an int (or vLLM's own enum): ignored too
    sp = SamplingParams(max_tokens=2, temperature=0.0, output_kind=kind)
    out = llm.generate([IDS], sp, use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 2  # finished outputs only, as vLLM's LLM forces


@pytest.mark.parametrize("value", [True, False])
def test_spaces_between_special_tokens_is_taken(value):
    assert SamplingParams(spaces_between_special_tokens=value).spaces_between_special_tokens is value
    with pytest.raises(SamplingParamsError, match="spaces_between_special_tokens must be true or false"):
        SamplingParams(spaces_between_special_tokens="yes")


# ------------------------------------------------------------------ 5. generate's and chat's vLLM keywords


def test_generate_takes_priority_all_zero_and_refuses_any_other(llm):
    outs = llm.generate([IDS, IDS[:2]], GREEDY, use_tqdm=False, priority=[0, 0])  # a TypeError before
    assert len(outs) == 2
    with pytest.raises(ValueError, match="priority must be all 0: radiance schedules requests first-come-first-served"):
        llm.generate([IDS, IDS[:2]], GREEDY, priority=[0, 1])
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        llm.generate([IDS, IDS[:2]], GREEDY, priority=[0])
    with pytest.raises(ValueError, match="lora_request must be None"):
        llm.generate([IDS], GREEDY, lora_request=object())
    assert not llm.engine.has_unfinished_requests()


def test_generate_honours_tokenization_kwargs(text_llm):
    text = "The quick brown fox jumps over the lazy dog."
    whole = text_llm.tokenizer(text).input_ids
    cut = text_llm.generate(text, GREEDY, use_tqdm=False,
                            tokenization_kwargs={"truncation": True, "max_length": 3})[0]  # a TypeError before
    assert cut.prompt_token_ids == whole[:3] and cut.prompt == text
    plain = text_llm.generate(text, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})[0]
    assert plain.prompt_token_ids == text_llm.tokenizer(text, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="tokenization_kwargs 'padding' not supported"):
        text_llm.generate(text, GREEDY, tokenization_kwargs={"padding": True})


def test_chats_vllm_keywords_are_arguments_not_template_variables(text_llm):
    out = chat(text_llm, tokenization_kwargs={"truncation": True, "max_length": 4},
               chat_template_content_format="string", mm_processor_kwargs=None)[0]
    assert "LEAK" not in out.prompt  # they reached the template as variables before
    assert out.prompt_token_ids == text_llm.tokenizer(out.prompt, add_special_tokens=False).input_ids[:4]
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": "fox"}]}]
    assert chat(text_llm, parts, chat_template_content_format="auto")[0].prompt.startswith("user: The quick\nfox\n")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of 'auto', 'string', 'openai'"):
        chat(text_llm, chat_template_content_format="xml")
    with pytest.raises(ValueError, match="mm_processor_kwargs must be None: radiance serves text only"):
        chat(text_llm, mm_processor_kwargs={"num_crops": 4})
    with pytest.raises(ValueError, match="tokenization_kwargs 'return_tensors' not supported"):
        chat(text_llm, tokenization_kwargs={"return_tensors": "pt"})


# ------------------------------------------------------------------ 6. stop_token_ids outside the vocabulary


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(RequestError, match=r"stop_token_ids has token id\(s\) outside the vocabulary") as info:
        llm.generate([IDS], SamplingParams(max_tokens=2, stop_token_ids=[3, vocab]), use_tqdm=False)
    assert info.value.field == "stop_token_ids"  # was served: the id could never stop it
    assert not llm.engine.has_unfinished_requests()


def test_the_server_answers_stop_token_ids_outside_the_vocabulary_with_a_400(fake_server):
    vocab = fake_server[1].vocab_size
    r = _post(fake_server, "/v1/completions", {"prompt": "SAY:hi", "stop_token_ids": [vocab + 5], "stream": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop_token_ids"


# ------------------------------------------------------------------ 7. seed -1


def test_seed_minus_one_is_no_seed(llm):
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=-1, ignore_eos=True)
    draws = {tuple(llm.generate([IDS], sp, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(4)}
    assert len(draws) > 1  # the same tokens every time before: -1 was a seed of its own


def test_the_server_takes_seed_minus_one_as_no_seed_for_every_choice(fake_server):
    r = _post(fake_server, "/v1/completions", {"prompt": "SAY:hi", "n": 2, "seed": -1})
    assert r.status_code == 200, r.text
    assert [params.seed for _, _, params in fake_server[1].requests[-2:]] == [None, None]  # [-1, 0] before


def test_the_sampling_seed_help_says_minus_one_is_no_seed(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "-1 is no seed (vLLM's), another negative one a seed of its own (default: none" in help_text


# ------------------------------------------------------------------ 8. vLLM's normalisations


def test_vllms_normalisations():
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(stop_token_ids=[5, 5, 6, 5]).stop_token_ids == (5, 6)
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ("a", "b")
    assert SamplingParams(temperature=2.0).temperature == 2.0
    with pytest.raises(SamplingParamsError, match=r"temperature must be in \[0, 2\], got 2.5") as info:
        SamplingParams(temperature=2.5)
    assert info.value.field == "temperature"


def test_a_tiny_temperature_is_raised_to_one_hundredth_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="radiance.engine.sampling_params"):
        sp = SamplingParams(temperature=0.001)
    assert sp.temperature == 0.01 and not sp.greedy
    assert "temperature 0.001 is less than 0.01" in caplog.text
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy stays greedy


def test_sampling_type_and_all_stop_token_ids():
    from radiance.engine.sampling_params import SamplingType

    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams().sampling_type is SamplingType.RANDOM
    assert SamplingParams(stop_token_ids=[4, 2]).all_stop_token_ids == {2, 4}


# ------------------------------------------------------------------ 9. CompletionOutput, llm_engine, tuples


def test_completion_output_takes_vllms_positional_order(llm):
    out = CompletionOutput(0, "x", [1], -0.5, None, "stop", 7)
    assert (out.cumulative_logprob, out.logprobs, out.finish_reason, out.stop_reason) == (-0.5, None, "stop", 7)
    got = llm.generate([IDS], SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "length" and isinstance(got.cumulative_logprob, float)
    assert len(got.logprobs) == 2


def test_llm_engine_is_vllms_name_of_the_engine(llm):
    assert llm.llm_engine is llm.engine


def test_chat_takes_a_tuple_of_conversations(text_llm):
    other = [{"role": "user", "content": "the lazy dog"}]
    outs = chat(text_llm, (HI, other))  # refused before: a tuple was not "a list of conversations"
    assert [o.prompt for o in outs] == ["user: The quick brown fox\nassistant:", "user: the lazy dog\nassistant:"]
