"""`LLM`: the offline, vLLM-shaped Python API (`from radiance import LLM, SamplingParams`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from numbers import Integral

import torch
from tqdm import tqdm

from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.config import EngineConfig
from radiance.engine.beam_search import BeamSearchOutput, BeamSearchParams
from radiance.engine.beam_search import beam_search as _beam_search
# vLLM's arguments: LLM(...)'s (VLLM_NO_EFFECT_ARGS, VLLM_DEFAULT_ONLY_ARGS there), generate's and chat's
from radiance.engine.llm_args import (_dtype_name, _max_logprobs, _short, _vllm_model_args, check_chat_args,
                                      check_lora_request, check_priority, conversations_of, template_variables,
                                      tokenizer_kwargs)
from radiance.engine.llm_engine import LLMEngine
from radiance.engine.loader import no_tokenizer_message
# CompletionOutput and GenerationOutput are importable from here as before
from radiance.engine.outputs import CompletionOutput, GenerationOutput
from radiance.engine.request_checks import SamplingParamsError, truncate_prompt
from radiance.engine.sampling_params import SamplingParams
from radiance.engine.vllm_logprobs import TokenTexts, vllm_logprobs
from radiance.errors import ConfigError


# vLLM's default of LLM(max_logprobs=...): the most logprobs / prompt_logprobs a request may ask for
DEFAULT_MAX_LOGPROBS = 20
# vLLM's TextPrompt / TokensPrompt keys (a prompt given as a dict)
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


class LLM:
    def __init__(self, model: str | None = None, quantization: str | None = "auto", device: str | None = None,
                 dtype: str | torch.dtype | None = None, checkpoint=None,
                 max_logprobs: int | None = DEFAULT_MAX_LOGPROBS, **config):
        """`config`: any field of the engine's config dataclasses (max_num_seqs=8, enforce_eager=True, ...), and
        vLLM's arguments (VLLM_NO_EFFECT_ARGS, VLLM_DEFAULT_ONLY_ARGS, tokenizer, revision) as they apply here.
        `checkpoint`: a checkpoint-like object to serve instead of opening `model`. `max_logprobs`: the most
        logprobs / prompt_logprobs a request may ask for (vLLM's, and its default 20; -1 or None: up to the
        vocabulary)."""
        model = _vllm_model_args(model, config)
        if "seed" in config and config["seed"] is None:  # vLLM's "not seeded": a fresh seed each run
            config["seed"] = int.from_bytes(os.urandom(8), "little", signed=True)
        engine_config = EngineConfig.from_flat(model=model, quantization=quantization or "auto", device=device,
                                               dtype=_dtype_name(dtype), **config)
        self.max_logprobs = _max_logprobs(max_logprobs)
        self.engine = LLMEngine(engine_config, checkpoint=checkpoint)
        self._counter = 0
        self.progress = True  # progress bars on stderr: generate's use_tqdm shows one only while this is set

    @classmethod
    def from_engine_config(cls, config: EngineConfig, checkpoint=None, progress: bool = True,
                           max_logprobs: int | None = DEFAULT_MAX_LOGPROBS) -> "LLM":
        """`progress`: progress bars on stderr (weight loading, generate's use_tqdm); False for --no-progress."""
        llm = cls.__new__(cls)
        llm.max_logprobs = _max_logprobs(max_logprobs)
        llm.engine = LLMEngine(config, checkpoint=checkpoint, progress=progress)
        llm._counter = 0
        llm.progress = progress
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of the engine (LLM.engine)."""
        return self.engine

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's accessor); None for a checkpoint without one."""
        return self.engine.tokenizer

    def _no_tokenizer(self, hint: str) -> ConfigError:
        """The error of a text prompt without a tokenizer, naming why there is none (a GGUF field, the file)."""
        return ConfigError(no_tokenizer_message(getattr(self.engine, "tokenizer_error", None), hint))

    def _encode(self, text: str, **kwargs) -> list[int]:
        """`text`'s token ids (kwargs to the tokenizer, e.g. add_special_tokens=False); not vLLM's `encode`,
        which embeds."""
        if self.tokenizer is None:  # was a TypeError on None for a chat prompt
            raise self._no_tokenizer("only lists of token ids can be prompts")
        return self.tokenizer(text, **kwargs).input_ids

    def _tokenize(self, prompt, kwargs: dict | None = None) -> tuple[str | None, list[int]]:
        """`kwargs`: the tokenizer's, for a text prompt (generate's tokenization_kwargs)."""
        kwargs = kwargs or {}
        if isinstance(prompt, dict):
            return self._tokenize_dict(prompt, kwargs)
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, **kwargs)
        if not _is_token_ids(prompt):  # int() took 1.7 as token 1; a tuple of ids failed as "int not iterable"
            raise ValueError(f"a prompt must be a string, a list of token ids or a {{'prompt': ...}} / "
                             f"{{'prompt_token_ids': [...]}} dict, got {_short(prompt)}")
        return None, [int(t) for t in prompt]

    def _tokenize_dict(self, prompt: dict, kwargs: dict) -> tuple[str | None, list[int]]:
        """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids} (its text, if it gives
        one too, is kept as the output's prompt). cache_salt is read by generate."""
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:  # multi_modal_data and the like: text only here
            raise ValueError(f"a prompt must be text or token ids: a prompt dict's keys are {', '.join(PROMPT_KEYS)}, "
                             f"got {', '.join(map(repr, unknown))}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not _is_token_ids(ids):
                raise ValueError(f"prompt_token_ids must be a list of token ids, got {_short(ids)}")
            return prompt.get("prompt"), [int(t) for t in ids]
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got {_short(prompt)}")
        return text, self._encode(text, **kwargs)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no SamplingParams: the sampling defaults of the model's
        generation_config.json over SamplingParams' own (vLLM's LLM does the same)."""
        return SamplingParams(**getattr(self.engine, "sampling_defaults", SamplingDefaults()).given())

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None, priority: list[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[GenerationOutput]:
        """prompts: a string, a list (or tuple, or 1-D array) of token ids, a vLLM prompt dict ({"prompt": text}
        or {"prompt_token_ids": ids}), or a list of these. sampling_params: one for all, or a list with one per
        prompt. use_tqdm (vLLM's): a progress bar on stderr, or a tqdm-like factory to make it; none where the
        LLM was made without progress bars. vLLM's priority (all 0: requests are served first-come-first-served),
        tokenization_kwargs (for text prompts: add_special_tokens, truncation, max_length) and lora_request (with
        LLM(enable_lora=True): a radiance.LoRARequest for every prompt, or a list of one LoRARequest or None per
        prompt).
        Every prompt and parameter is checked before any is queued."""
        _check_use_tqdm(use_tqdm)
        if lora_request is not None and not getattr(self.engine, "lora_enabled", False):  # before the prompts
            check_lora_request(lora_request, 1, False)
        encode_kwargs = tokenizer_kwargs(tokenization_kwargs)
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) and len(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids, a prompt dict or a list of these, "
                             f"got {_short(prompts)}")
        loras = check_lora_request(lora_request, len(prompts), getattr(self.engine, "lora_enabled", False))
        # each adapter loaded (or refused) before any request is queued
        loras = [None if lora is None else self.engine.check_lora_request(lora) for lora in loras]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        check_priority(priority, len(prompts))
        params_list = [_with_prompt_salt(prompt, p) for prompt, p in zip(prompts, params_list)]
        results: list[GenerationOutput] = []
        request_slots: dict[str, tuple[int, int]] = {}
        tokenized = [self._tokenize(prompt, encode_kwargs) for prompt in prompts]
        tokenized = [(text, truncate_prompt(ids, p.truncate_prompt_tokens, self.engine.max_model_len, p.max_tokens))
                     for (text, ids), p in zip(tokenized, params_list)]
        for (_, ids), p in zip(tokenized, params_list):  # reject a bad prompt before queueing any
            self._check_logprobs(p)
        # the engine takes a count of alternatives: vLLM's -1 (all of them) is the vocabulary's size
        params_list = [_whole_vocabulary(p, self.engine.vocab_size) for p in params_list]
        for (_, ids), p in zip(tokenized, params_list):
            self.engine.check_request(ids, p)
        try:
            self._add_all(tokenized, params_list, results, request_slots, loras)
            self._run(results, request_slots, use_tqdm, TokenTexts(self.tokenizer),
                      [p.detokenize for p in params_list])
        except BaseException:  # Ctrl-C or an error: leave nothing queued for the next call
            for request_id in request_slots:
                self.engine.abort_request(request_id)
            raise
        return results

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        # [] is not the default
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * num_prompts
        if len(params_list) != num_prompts:
            raise ValueError(f"{len(params_list)} sampling params for {num_prompts} prompts")
        bad = [p for p in params_list if not isinstance(p, SamplingParams)]
        if bad:  # a dict failed deep in the engine as "'dict' object has no attribute 'logit_bias'"
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got {_short(bad[0])}")
        for p in {id(p): p for p in params_list}.values():  # assignment leaves the rules between fields to here
            p.check_across_fields()
        return params_list

    def _check_logprobs(self, params: SamplingParams) -> None:
        """max_logprobs, as vLLM's LLM refuses a request over it (-1, the whole vocabulary, counts as its size)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if self.max_logprobs is None or value is None:
                continue
            if value == -1 and self.engine.vocab_size > self.max_logprobs:
                raise SamplingParamsError(f"{name} is -1, the whole vocabulary ({self.engine.vocab_size} tokens), "
                                          f"more than max_logprobs {self.max_logprobs} (allow it with "
                                          "LLM(max_logprobs=-1))", name)
            if value > self.max_logprobs:
                raise SamplingParamsError(f"{name} is {value}, more than max_logprobs {self.max_logprobs} (raise "
                                          "it with LLM(max_logprobs=...); -1: up to the vocabulary)", name)

    def _add_all(self, tokenized, params_list, results, request_slots, loras=None) -> None:
        loras = loras or [None] * len(tokenized)
        for i, ((text, ids), p, lora) in enumerate(zip(tokenized, params_list, loras)):
            prompt_id = str(self._counter)  # vLLM's request ids, and its "{choice}_{id}" for n > 1
            self._counter += 1
            results.append(GenerationOutput(text, ids, [None] * p.n, request_id=prompt_id))  # type: ignore[list-item]
            for j in range(p.n):
                request_id = prompt_id if p.n == 1 else f"{j}_{prompt_id}"
                sub = p if p.n == 1 else p.for_choice(j)
                if lora is None:
                    self.engine.add_request(request_id, ids, sub)
                else:
                    self.engine.add_request(request_id, ids, sub, lora_request=lora)
                request_slots[request_id] = (i, j)

    def _progress_bar(self, use_tqdm: bool | Callable, total: int):
        """The bar counting finished outputs: tqdm's, transient (leave=False) as radiance's other bars, or
        the factory's; a disabled one where none is wanted (use_tqdm False, or no progress bars: --no-progress)."""
        if use_tqdm and self.progress and callable(use_tqdm):
            return use_tqdm(total=total, desc="generating")
        return tqdm(total=total, desc="generating", unit="output", leave=False,
                    disable=not (use_tqdm and self.progress))

    def _run(self, results, request_slots, use_tqdm: bool | Callable, texts: TokenTexts,
             detokenize: list[bool]) -> None:
        """`detokenize`: per prompt, whether its logprobs name their tokens' texts."""
        bar = self._progress_bar(use_tqdm, len(request_slots))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in request_slots:
                        slot = request_slots[out.request_id]
                        self._collect(results, slot, out, texts if detokenize[slot[0]] else None)
                        bar.update(1)
        finally:  # an interrupted call leaves no bar half drawn
            bar.close()

    @staticmethod
    def _collect(results: list[GenerationOutput], slot: tuple[int, int], out, texts: TokenTexts | None) -> None:
        """A finished engine output into choice j of prompt i's result, its logprobs in vLLM's shape (the engine's
        TokenLogprob entries stay the server's). `texts`: None for detokenize=False (no decoded_token)."""
        i, j = slot
        # the engine leaves the text "" for SamplingParams(detokenize=False): vLLM's ids only
        results[i].outputs[j] = CompletionOutput(j, out.text, out.token_ids, out.cumulative_logprob,
                                                 vllm_logprobs(out.logprobs, texts), out.finish_reason,
                                                 out.stop_reason)
        results[i].num_cached_tokens = max(results[i].num_cached_tokens, out.num_cached_tokens)
        results[i].metrics = out.times  # outputs come in finishing order: the last is the latest
        if out.prompt_logprobs is not None and results[i].prompt_logprobs is None:  # every choice scores the same
            results[i].prompt_logprobs = vllm_logprobs(out.prompt_logprobs, texts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            chat_template_content_format: str = "auto", **kwargs) -> str:
        """The prompt text; with `tools`, the model's "tool_use" template where it ships one (as transformers).
        `chat_template` renders in place of the model's; `continue_final_message` ends the prompt inside the last
        message (its end cut off), for the model to go on with it; `chat_template_content_format` is vLLM's (see
        chat); `kwargs` reach the template as variables."""
        if continue_final_message and add_generation_prompt:  # transformers' and vLLM's rule
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        template = chat_template or self.engine.chat_template
        if kwargs.get("tools") is not None and not chat_template:  # transformers' pick: tools given, even []
            template = (getattr(self.engine, "chat_templates", None) or {}).get("tool_use") or template
        from radiance.server.chat_template import (content_format_of, cut_at_continue_tag, final_text, render_chat,
                                                   tag_final_message, with_content_format)
        # "auto" reads the template that renders (vLLM's detection), the tokenizer's own where radiance has none
        own = getattr(self.tokenizer, "chat_template", None)
        detected_in = template or (own if isinstance(own, str) else None)
        messages = with_content_format(messages, content_format_of(detected_in, chat_template_content_format))
        if not template:
            if self.tokenizer is None:
                raise self._no_tokenizer("it has no chat template either")
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **kwargs)
        # the server passes them too: Llama 3's template starts with {{ bos_token }}, and chat encodes the text
        # without special tokens, so a prompt without them lost its BOS
        kwargs.setdefault("bos_token", getattr(self.tokenizer, "bos_token", None) or "")
        kwargs.setdefault("eos_token", getattr(self.tokenizer, "eos_token", None) or "")
        if not continue_final_message:
            return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        prompt = cut_at_continue_tag(render_chat(template, tag_final_message(messages), add_generation_prompt=False,
                                                 **kwargs), final_text(messages[-1]))
        if prompt is None:
            raise ValueError("continue_final_message: the chat template does not write the final message's content")
        return prompt

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request=None, chat_template_content_format: str = "auto",
             tokenization_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None,
             **template_kwargs) -> list[GenerationOutput]:
        """messages: one conversation (list of {"role", "content"} dicts; content a string or text parts) or a
        list (or tuple) of conversations. vLLM's arguments; `chat_template_kwargs` (and any other keyword) reach
        the template as variables ({"enable_thinking": False} for Qwen3); as in vLLM, chat()'s own arguments win
        over kwargs of their names (add_generation_prompt and continue_final_message there change nothing; tools
        and chat_template there are used where chat() is given none). vLLM's chat_template_content_format: "string"
        (text parts joined by newlines), "openai" (content as a list of {"type": "text", "text": ...} parts, a string
        as one) or "auto" ("openai" for a template that loops over a message's content, vLLM's detection, else
        "string"); tokenization_kwargs (of the rendered prompt, which is encoded without special tokens unless they
        say add_special_tokens), mm_processor_kwargs and lora_request (as generate's, one per conversation). Each
        output's prompt is the rendered template text, as vLLM's."""
        conversations = conversations_of(messages)
        loras = check_lora_request(lora_request, len(conversations), getattr(self.engine, "lora_enabled", False))
        check_chat_args(chat_template_content_format, mm_processor_kwargs)
        # the template writes its own special tokens
        encode_kwargs = tokenizer_kwargs(tokenization_kwargs, {"add_special_tokens": False})
        variables = template_variables(template_kwargs, chat_template_kwargs)
        # as vLLM's LLM.chat merges its own arguments over chat_template_kwargs: add_generation_prompt and
        # continue_final_message are chat()'s alone; tools and chat_template there count only where chat() has none
        for key in ("add_generation_prompt", "continue_final_message"):
            variables.pop(key, None)
        if tools is not None:
            variables["tools"] = tools
        chat_template = chat_template if chat_template is not None else variables.pop("chat_template", None)
        variables.pop("chat_template", None)
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "chat_template_content_format": chat_template_content_format}
        prompts = []
        for conversation in conversations:
            text = self.apply_chat_template(conversation, **options, **variables)
            # text and ids: the output's prompt is the text (vLLM's), the ids are what the template encodes to
            prompts.append({"prompt": text, "prompt_token_ids": self._encode(text, **encode_kwargs)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=None if lora_request is None else loras)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt the beam_width best sequences by cumulative logprob /
        length ** length_penalty, best first (radiance.engine.beam_search)."""
        if lora_request is not None and not getattr(self.engine, "lora_enabled", False):
            check_lora_request(lora_request, 1, False)
        loras = None
        if lora_request is not None:
            from radiance.engine.beam_search import _prompt_list
            loras = check_lora_request(lora_request, len(_prompt_list(prompts)), True)
            loras = [None if lora is None else self.engine.check_lora_request(lora) for lora in loras]
        return _beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit,
                            lora_requests=loras)

def _whole_vocabulary(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params` with vLLM's logprobs / prompt_logprobs -1 as the vocabulary's size."""
    whole = {name: vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
    return replace(params, **whole) if whole else params


def _check_use_tqdm(use_tqdm) -> None:
    """vLLM's use_tqdm: a bool, or a callable returning a tqdm-like bar (update, close); checked before anything
    is queued ("no" was a truthy string)."""
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise ValueError(f"use_tqdm must be True, False or a tqdm-like factory (a callable taking total=, desc=), "
                         f"got {_short(use_tqdm)}")


def _with_prompt_salt(prompt, params: SamplingParams) -> SamplingParams:
    """A prompt dict's cache_salt (vLLM's place for it) over its SamplingParams' own."""
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        return replace(params, cache_salt=prompt["cache_salt"])
    return params


def _is_token_ids(prompt) -> bool:
    """A list, tuple or 1-D array of integers (numpy's too; not floats, not bools)."""
    if isinstance(prompt, (list, tuple)) or getattr(prompt, "ndim", None) == 1:
        return all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt)
    return False

