"""The offline API's last vLLM differences, resolved: use_tqdm on by default (and a tqdm-like factory), no
decoding for detokenize=False, max_logprobs 20 by default, an empty stop string refused, and vLLM's names of the
output classes."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

import radiance
from radiance import LLM, SamplingParams
from radiance.config import EngineConfig
from radiance.engine import llm as llm_module
from radiance.engine import llm_engine
from radiance.engine import outputs as outputs_module
from radiance.engine.request_checks import SamplingParamsError

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_num_seqs=4)


@pytest.fixture(scope="module")
def text_llm(tiny_text_llm):
    return tiny_text_llm(max_num_seqs=4)


class RecordingBar:
    """A tqdm-like bar (what a use_tqdm factory returns) that keeps what it was told."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.updates = []
        self.closed = False

    def update(self, n=1):
        self.updates.append(n)

    def close(self):
        self.closed = True


# ------------------------------------------------------------------ use_tqdm


def test_generate_shows_a_progress_bar_by_default(llm, capsys):
    capsys.readouterr()
    llm.generate(PROMPT, GREEDY)
    assert "generating" in capsys.readouterr().err  # vLLM's default; was off
    llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert "generating" not in capsys.readouterr().err


def test_chat_shows_a_progress_bar_by_default():
    assert inspect.signature(LLM.chat).parameters["use_tqdm"].default is True


def test_no_progress_bar_where_progress_bars_are_off(tiny_model_dir, capsys):
    """LLM.from_engine_config(progress=False) (the CLI's --no-progress): no bar, use_tqdm or not."""
    path, _ = tiny_model_dir("llama3")
    config = EngineConfig.from_flat(model=path, device="cpu", dtype="float32", max_num_seqs=2)
    quiet = LLM.from_engine_config(config, progress=False)
    capsys.readouterr()
    factory_calls = []
    quiet.generate(PROMPT, GREEDY)
    quiet.generate(PROMPT, GREEDY, use_tqdm=lambda **kwargs: factory_calls.append(kwargs) or RecordingBar())
    assert "generating" not in capsys.readouterr().err and not factory_calls


def test_use_tqdm_takes_a_tqdm_like_factory(llm):
    bars = []

    def factory(**kwargs):
        bars.append(RecordingBar(**kwargs))
        return bars[-1]

    llm.generate([PROMPT, PROMPT[:2]], SamplingParams(n=2, max_tokens=2, seed=3), use_tqdm=factory)
    (bar,) = bars
    assert bar.kwargs["total"] == 4 and sum(bar.updates) == 4 and bar.closed  # one per choice of each prompt


def test_a_bar_is_closed_when_generation_fails(llm, monkeypatch):
    bars = []
    monkeypatch.setattr(llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(PROMPT, GREEDY, use_tqdm=lambda **kwargs: bars.append(RecordingBar(**kwargs)) or bars[-1])
    assert bars[0].closed


def test_a_use_tqdm_that_is_neither_bool_nor_callable_is_named(llm):
    with pytest.raises(ValueError, match="use_tqdm must be .* got 'yes'"):
        llm.generate(PROMPT, GREEDY, use_tqdm="yes")
    assert not llm.engine.sequences  # refused before anything was queued


# ------------------------------------------------------------------ detokenize=False


def run_engine(engine, request_id: str, ids: list[int], params: SamplingParams):
    engine.add_request(request_id, ids, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_detokenize_false_is_not_decoded_by_the_engine(text_llm):
    """The engine decoded every token and LLM dropped the text: now the engine's own output has none."""
    ids = text_llm.get_tokenizer()("The quick brown fox").input_ids
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    decoded = run_engine(text_llm.engine, "with-text", ids, params)
    bare = run_engine(text_llm.engine, "ids-only", ids, replace(params, detokenize=False))
    assert decoded.text and bare.text == ""
    assert bare.token_ids == decoded.token_ids and len(bare.logprobs) == len(decoded.logprobs) == 6


def test_detokenize_false_skips_the_decoder(text_llm, monkeypatch):
    made = []
    real = llm_engine.IncrementalDetokenizer

    def recording(tokenizer, *args, **kwargs):
        made.append(tokenizer)
        return real(tokenizer, *args, **kwargs)

    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", recording)
    out = text_llm.generate("The quick", SamplingParams(max_tokens=3, temperature=0.0, detokenize=False))[0]
    assert made == [None] and out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3


# ------------------------------------------------------------------ max_logprobs


def test_max_logprobs_defaults_to_vllms_20(llm):
    assert inspect.signature(LLM).parameters["max_logprobs"].default == 20
    assert llm.max_logprobs == 20
    with pytest.raises(SamplingParamsError, match="prompt_logprobs is 21, more than max_logprobs 20 .*max_logprobs="):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=21))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))[0].outputs[0]
    assert len(out.logprobs[0]) == 20  # the greedy token is among its 20 alternatives


def test_max_logprobs_minus_one_is_the_vocabulary(tiny_llm):
    unlimited = tiny_llm(max_num_seqs=2, max_logprobs=-1)
    out = unlimited.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=21))[0].outputs[0]
    assert len(out.logprobs[0]) == 21


def test_from_engine_config_has_the_same_default(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    config = EngineConfig.from_flat(model=path, device="cpu", dtype="float32", max_num_seqs=2)
    with pytest.raises(SamplingParamsError, match="logprobs is 21, more than max_logprobs 20"):
        LLM.from_engine_config(config, progress=False).generate(PROMPT, SamplingParams(max_tokens=1, logprobs=21))


# ------------------------------------------------------------------ stop=""


@pytest.mark.parametrize("stop", ["", ["done", ""]])
def test_an_empty_stop_string_is_refused(stop):
    with pytest.raises(SamplingParamsError, match=r"stop strings must not be empty, got stop \[.*''\]"):
        SamplingParams(stop=stop)  # it matched nothing, silently


# ------------------------------------------------------------------ vLLM's output class names


def test_vllm_output_names_are_the_same_classes(llm):
    from radiance import CompletionOutput, GenerationOutput, RequestOutput

    assert RequestOutput is GenerationOutput is llm_module.GenerationOutput is outputs_module.GenerationOutput
    assert radiance.engine.RequestOutput is RequestOutput  # one class under vLLM's name, the engine's is StepOutput
    assert CompletionOutput is llm_module.CompletionOutput is outputs_module.CompletionOutput
    out = llm.generate(PROMPT, GREEDY)[0]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert all(getattr(radiance, name) is not None for name in radiance.__all__)
