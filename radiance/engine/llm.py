"""`LLM`: the offline, vLLM-shaped Python API (`from radiance import LLM, SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from tqdm import tqdm

from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.config import EngineConfig
from radiance.engine.llm_engine import LLMEngine
from radiance.engine.loader import no_tokenizer_message
from radiance.engine.outputs import TokenLogprob
from radiance.engine.sampling_params import SamplingParams
from radiance.errors import ConfigError


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # the sum of the output tokens' logprobs; None without logprobs
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)


@dataclass
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs


class LLM:
    def __init__(self, model: str | None = None, quantization: str = "auto", device: str | None = None,
                 dtype: str | None = None, checkpoint=None, **config):
        """`config`: any field of the engine's config dataclasses (max_num_seqs=8, enforce_eager=True, ...).
        `checkpoint`: a checkpoint-like object to serve instead of opening `model`."""
        engine_config = EngineConfig.from_flat(model=model, quantization=quantization, device=device, dtype=dtype,
                                               **config)
        self.engine = LLMEngine(engine_config, checkpoint=checkpoint)
        self._counter = 0

    @classmethod
    def from_engine_config(cls, config: EngineConfig, checkpoint=None, progress: bool = True) -> "LLM":
        """`progress`: the weight-loading bar on stderr."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, checkpoint=checkpoint, progress=progress)
        llm._counter = 0
        return llm

    @property
    def tokenizer(self):
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

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if not _is_token_ids(prompt):  # int() took 1.7 as token 1; a tuple of ids failed as "int not iterable"
            raise ValueError(f"a prompt must be a string or a list of token ids, got {_short(prompt)}")
        return None, [int(t) for t in prompt]

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no SamplingParams: the sampling defaults of the model's
        generation_config.json over SamplingParams' own (vLLM's LLM does the same)."""
        return SamplingParams(**getattr(self.engine, "sampling_defaults", SamplingDefaults()).given())

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationOutput]:
        """prompts: a string, a list (or tuple, or 1-D array) of token ids, or a list of either."""
        if isinstance(prompts, str) or _is_token_ids(prompts) and len(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids or a list of either, "
                             f"got {_short(prompts)}")
        # [] is not the default
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        bad = [p for p in params_list if not isinstance(p, SamplingParams)]
        if bad:  # a dict failed deep in the engine as "'dict' object has no attribute 'logit_bias'"
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got {_short(bad[0])}")
        results: list[GenerationOutput] = []
        request_slots: dict[str, tuple[int, int]] = {}
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        for (_, ids), p in zip(tokenized, params_list):  # reject a bad prompt before queueing any
            self.engine.check_request(ids, p)
        try:
            self._add_all(tokenized, params_list, results, request_slots)
            self._run(results, request_slots, use_tqdm)
        except BaseException:  # Ctrl-C or an error: leave nothing queued for the next call
            for request_id in request_slots:
                self.engine.abort_request(request_id)
            raise
        return results

    def _add_all(self, tokenized, params_list, results, request_slots) -> None:
        for i, ((text, ids), p) in enumerate(zip(tokenized, params_list)):
            results.append(GenerationOutput(text, ids, [None] * p.n))  # type: ignore[list-item]
            for j in range(p.n):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                sub = p if p.n == 1 else p.for_choice(j)
                self.engine.add_request(request_id, ids, sub)
                request_slots[request_id] = (i, j)

    def _run(self, results, request_slots, use_tqdm: bool) -> None:
        bar = tqdm(total=len(request_slots), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in request_slots:
                    i, j = request_slots[out.request_id]
                    results[i].outputs[j] = CompletionOutput(j, out.text, out.token_ids, out.finish_reason, out.logprobs,
                                                             out.cumulative_logprob, out.stop_reason)
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, out.num_cached_tokens)
                    if out.prompt_logprobs is not None:
                        results[i].prompt_logprobs = out.prompt_logprobs
                    bar.update(1)
        bar.close()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; with `tools`, the model's "tool_use" template where it ships one (as transformers)."""
        template = self.engine.chat_template
        if kwargs.get("tools"):
            template = (getattr(self.engine, "chat_templates", None) or {}).get("tool_use") or template
        from radiance.server.chat_template import render_chat
        if template:
            return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if self.tokenizer is None:
            raise self._no_tokenizer("it has no chat template either")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=template, **kwargs)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False,
             **template_kwargs) -> list[GenerationOutput]:
        """messages: one conversation (list of {"role", "content"} dicts) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, list) or not all(_is_conversation(c) for c in conversations):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such lists")
        prompts = []
        for conversation in conversations:
            text = self.apply_chat_template(conversation, **template_kwargs)
            prompts.append(self._encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return outputs


def _is_token_ids(prompt) -> bool:
    """A list, tuple or 1-D array of integers (numpy's too; not floats, not bools)."""
    if isinstance(prompt, (list, tuple)) or getattr(prompt, "ndim", None) == 1:
        return all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt)
    return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_conversation(messages) -> bool:
    return isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)
