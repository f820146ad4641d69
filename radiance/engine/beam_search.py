"""Beam search over LLM.generate, as vLLM's offline `LLM.beam_search` runs it (vllm/entrypoints/llm.py and
vllm/beam_search.py): each step asks generate for one token with 2 * beam_width logprobs per live beam (one batched
call over every live beam of every prompt, so the prefix cache serves each beam's shared prompt), grows every beam
by each of those tokens, sets a beam ending in EOS aside as completed (unless ignore_eos), and keeps the
beam_width best by score: cumulative logprob / length ** length_penalty."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy
from tqdm import tqdm

from radiance.engine.outputs import Logprob
from radiance.engine.request_checks import SamplingParamsError
from radiance.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (its fields and defaults), checked on construction as SamplingParams is."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: each step's token greedy; the candidates' logprobs are the model's own either way
    length_penalty: float = 1.0  # the score divides by length ** this: above 1 favours long sequences
    # vLLM's field; its offline beam search (this one) keeps EOS in the tokens and text either way, so it changes
    # nothing here (only vLLM's server reads it)
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def check(cond, msg, name):
            if not cond:
                raise SamplingParamsError(msg, name)

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            # a bool is an Integral, but True beams is a mistake; 2.0 would fail later inside range()
            check(isinstance(value, Integral) and not isinstance(value, bool),
                  f"{name} must be an integer, got {value!r}", name)
            check(value >= 1, f"{name} must be at least 1, got {value}", name)
            object.__setattr__(self, name, int(value))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            check(isinstance(value, (Integral, numpy.bool_)) and value in (True, False),
                  f"{name} must be true or false, got {value!r}", name)
            object.__setattr__(self, name, bool(value))
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            check(isinstance(value, Real) and not isinstance(value, bool), f"{name} must be a number, got {value!r}",
                  name)
            # NaN compares false everywhere: it would sort beams arbitrarily or sample garbage
            check(math.isfinite(value), f"{name} must be finite, got {value}", name)
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}", "temperature")


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's): `tokens` are the prompt's then the output's; `logprobs` holds, per output token, the
    {token id: Logprob} dict of the step that chose it (all the candidates of that step)."""

    orig_prompt: dict  # {"prompt_token_ids": [...], "prompt": text or None[, "cache_salt": ...]}
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: object = None  # vLLM's field: the radiance.LoRARequest the beam runs with (None: the base)
    cum_logprob: float = 0.0
    text: str | None = None  # filled on return: the prompt and output decoded (None without a tokenizer)
    # vLLM's server fills these ("stop" and the EOS id, else "length"); here every returned sequence has them
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[len(self.orig_prompt["prompt_token_ids"]):]


@dataclass
class BeamSearchOutput:
    """One prompt's result: up to beam_width sequences, best score first."""

    sequences: list[BeamSearchSequence]


def _is_eos(token_id: int, eos_token_id: int | Collection[int] | None) -> bool:
    if eos_token_id is None:
        return False
    if isinstance(eos_token_id, Integral):
        return token_id == eos_token_id
    return token_id in eos_token_id


def get_beam_search_score(tokens: list[int], cumulative_logprob: float,
                          eos_token_id: int | Collection[int] | None, length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): cumulative_logprob / length ** length_penalty, where the length counts the
    prompt's tokens too (as vLLM's does) and not a final EOS."""
    seq_len = len(tokens)
    if tokens and _is_eos(tokens[-1], eos_token_id):
        seq_len -= 1
    # only a lone EOS has no length left; 0 ** p would divide by zero (or fail for p < 0)
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | Collection[int] | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)
    return sort_beams_key


class _Instance:
    """One prompt's search: its live beams, those ended by EOS, and how many steps its context leaves room for."""

    def __init__(self, orig_prompt: dict, max_steps: int):
        self.beams = [BeamSearchSequence(orig_prompt, list(orig_prompt["prompt_token_ids"]))]
        self.completed: list[BeamSearchSequence] = []
        self.max_steps = max_steps


def beam_search(llm, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None, lora_requests: list | None = None) -> list[BeamSearchOutput]:
    """vLLM's LLM.beam_search on `llm` (a radiance LLM). prompts: a list of strings, token-id lists or vLLM prompt
    dicts ({"prompt": text} / {"prompt_token_ids": ids}, with an optional cache_salt), or one of these. Returns
    one BeamSearchOutput per prompt, in order. concurrency_limit: search that many prompts at a time (None: all).
    lora_requests: one radiance.LoRARequest or None per prompt (None: every prompt on the base)."""
    if not isinstance(params, BeamSearchParams):
        raise SamplingParamsError(f"params must be BeamSearchParams, got {type(params).__name__}", "params")
    if not isinstance(use_tqdm, (bool, numpy.bool_)):  # "no" was truthy
        raise ValueError(f"use_tqdm must be True or False, got {use_tqdm!r}")
    if concurrency_limit is not None and not (isinstance(concurrency_limit, Integral)
                                              and not isinstance(concurrency_limit, bool) and concurrency_limit >= 1):
        raise ValueError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}")
    engine = llm.engine
    tokenizer = llm.tokenizer
    eos = _eos_token_ids(llm)
    sort_key = create_sort_beams_key_function(eos, params.length_penalty)
    # 2 * beam_width candidates per beam, as vLLM (after transformers) asks: enough that beam_width survive even if
    # up to half end in EOS. More than the vocabulary is the whole vocabulary (the engine refuses a larger count).
    step_params = SamplingParams(logprobs=min(2 * params.beam_width, engine.vocab_size), max_tokens=1,
                                 temperature=params.temperature)
    if llm.max_logprobs is not None and step_params.logprobs > llm.max_logprobs:
        raise SamplingParamsError(f"beam_width {params.beam_width} asks for {step_params.logprobs} logprobs per step, "
                                  f"more than max_logprobs {llm.max_logprobs}: use beam_width "
                                  f"{llm.max_logprobs // 2} or less, or raise LLM(max_logprobs=...)", "beam_width")

    instances = [_new_instance(llm, prompt, params, step_params) for prompt in _prompt_list(prompts)]
    for inst, lora in zip(instances, lora_requests or ()):
        for beam in inst.beams:
            beam.lora_request = lora
    if use_tqdm and concurrency_limit is not None:  # vLLM's rule: the bar counts steps of one batch of prompts
        logger.warning("beam_search: no progress bar with concurrency_limit")
        use_tqdm = False
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        # the bar's total is max_tokens: the search may end sooner, when every beam has ended in EOS
        steps = tqdm(range(params.max_tokens), desc="Beam search", unit="token", leave=False,
                     disable=not (use_tqdm and getattr(llm, "progress", True)))
        try:
            for step in steps:
                live = [inst for inst in batch if inst.beams and step < inst.max_steps]
                if not live:
                    break
                _step(llm, live, step_params, params, eos, sort_key)
        finally:
            steps.close()

    outputs = []
    for inst in instances:
        # completed first: on equal scores a sequence that ended in EOS sorts ahead (a stable sort, as vLLM's)
        best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[:params.beam_width]
        for seq in best:
            # vLLM decodes the whole sequence, prompt included, special tokens (EOS) kept
            seq.text = tokenizer.decode(seq.tokens) if tokenizer is not None else None
            if seq.finish_reason is None:
                seq.finish_reason = "length"
        outputs.append(BeamSearchOutput(best))
    return outputs


def _step(llm, live: list[_Instance], step_params: SamplingParams, params: BeamSearchParams, eos,
          sort_key) -> None:
    """One token for every live beam of `live` in one generate call; each instance keeps its beam_width best."""
    beams = [beam for inst in live for beam in inst.beams]
    loras = [beam.lora_request for beam in beams]
    results = llm.generate([_request(beam) for beam in beams], step_params, use_tqdm=False,
                           lora_request=loras if any(lora is not None for lora in loras) else None)
    position = 0
    for inst in live:
        grown: list[BeamSearchSequence] = []
        for beam in inst.beams:
            out = results[position].outputs[0]
            position += 1
            if not out.logprobs:  # vLLM drops a beam that came back without logprobs (aborted)
                continue
            candidates = out.logprobs[0]  # the chosen token first, then the others most likely first
            for token_id, entry in candidates.items():
                seq = BeamSearchSequence(beam.orig_prompt, beam.tokens + [token_id], beam.logprobs + [candidates],
                                         lora_request=beam.lora_request, cum_logprob=beam.cum_logprob + entry.logprob)
                if _is_eos(token_id, eos) and not params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", token_id  # as vLLM's server marks them
                    inst.completed.append(seq)
                else:
                    grown.append(seq)
        inst.beams = sorted(grown, key=sort_key, reverse=True)[:params.beam_width]


def _request(beam: BeamSearchSequence):
    """The generate prompt that continues `beam`: its tokens, with its prompt's cache_salt."""
    salt = beam.orig_prompt.get("cache_salt")
    return beam.tokens if salt is None else {"prompt_token_ids": beam.tokens, "cache_salt": salt}


def _new_instance(llm, prompt, params: BeamSearchParams, step_params: SamplingParams) -> _Instance:
    """A prompt tokenized as generate does, checked before any step runs (empty, out of the vocabulary, past the
    context: the engine's errors); its steps end where the context does, as vLLM's server caps max_tokens."""
    text, ids = llm._tokenize(prompt)
    orig = {"prompt_token_ids": ids, "prompt": text}
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        orig["cache_salt"] = prompt["cache_salt"]
    llm.engine.check_request(ids, step_params)
    return _Instance(orig, min(params.max_tokens, llm.engine.max_model_len - len(ids)))


def _prompt_list(prompts) -> list:
    """vLLM takes a list; one prompt alone (a string, dict or token-id list) is taken too, as generate takes it."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if getattr(prompts, "ndim", None) == 1:  # one prompt as a 1-D array of token ids, as generate takes it
        return [[int(t) for t in prompts]]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, Integral) and not isinstance(t, bool)
                                                              for t in prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (strings, token-id lists or prompt dicts), got "
                         f"{type(prompts).__name__}")
    return list(prompts)


def _eos_token_ids(llm) -> int | frozenset[int] | None:
    """vLLM's EOS: the tokenizer's eos_token_id; a checkpoint without a tokenizer has the engine's EOS ids."""
    tokenizer = llm.tokenizer
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    return frozenset(llm.engine.eos_token_ids) or None
