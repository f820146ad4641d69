"""The synchronous engine: requests in, one scheduled model step at a time, outputs back."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque

import torch

from radiance.config import EngineConfig
from radiance.engine.block_manager import BlockManager
from radiance.engine.detokenizer import IncrementalDetokenizer
from radiance.engine.llm_args import _short
from radiance.engine.loader import load_model
from radiance.engine.model_runner import ModelRunner
from radiance.engine.outputs import (INTER_TOKEN_BUCKETS, ITERATION_TOKEN_BUCKETS, EngineStats, StepHistogram,
                                     StepOutput, RequestTimes, TokenLogprob)
from radiance.engine.overlap import DecodeAhead
from radiance.engine.request_checks import check_fits_context, check_token_ids
from radiance.engine.sampling_params import SamplingParams, generator_seed, tokenized_bad_words
from radiance.engine.scheduler import ScheduledSequence, Scheduler
from radiance.engine.sequence import Sequence, SequenceStatus
from radiance.engine.speculation import NgramSpeculator
from radiance.engine.state_cache import has_recurrent_state, serving_config
from radiance.engine.structured_output import GrammarBackend, StructuredOutput, StructuredOutputError
from radiance.layers.sampler import BadWords
from radiance.lora import LoraManager, LoRARequest

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, checkpoint=None, progress: bool = True):
        self.config = config or EngineConfig()
        loaded = load_model(self.config, checkpoint=checkpoint, progress=progress)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.tokenizer_error = loaded.tokenizer_error  # why there is none: for the errors of text prompts
        self.chat_template = loaded.chat_template
        self.chat_templates = loaded.chat_templates  # by name; "tool_use" serves requests with tools
        self.sampling_defaults = loaded.sampling_defaults  # generation_config.json's, for the server
        self.model_name = loaded.name
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.eos_token_ids = set(loaded.eos_token_ids)
        if has_recurrent_state(self.model):
            self.config = serving_config(self.config, self.model, self.device, self.dtype)
        # LoRA: the model's linears wrapped before the runner captures its graphs with them
        self.lora = (LoraManager(self.config.lora, self.model, self.device, self.dtype)
                     if self.config.lora.enable_lora else None)
        self.runner = ModelRunner(self.model, self.config, self.device, self.dtype,
                                  lora_context=self.lora.context if self.lora is not None else None)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.model.config.vocab_size  # the logits' width: prompt and bias ids are checked against it
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.cache.block_size,
                                          self.config.cache.enable_prefix_caching,
                                          prefer_in_order=self.device.type == "cpu", layout=self.runner.kv_layout,
                                          state_slots=self.runner.state_slots)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, lora=self.lora)
        overlap = self.config.runner.overlap_decode
        self.overlap_decode = self.runner.decode_graphs is not None if overlap is None else overlap
        self.speculator = NgramSpeculator(self.config, self.scheduler, self.block_manager, self.max_model_len)
        # a model with recurrent state: a step queued ahead must run as queued (state_cache's docstring)
        self.ahead = DecodeAhead(self.runner, self.scheduler, self.block_manager, self.speculator, self.max_model_len,
                                 pinned=has_recurrent_state(self.model))
        self._grammar_backend: GrammarBackend | None = None  # built on the first structured-output request
        self._grammar_lock = threading.Lock()  # the server compiles on its own thread (warm_grammar_backend)
        self.sequences: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._aborted: deque[StepOutput] = deque()
        self._arrivals = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.iteration_tokens = StepHistogram(ITERATION_TOKEN_BUCKETS)  # for /metrics, as EngineStats
        self.inter_token_latency = StepHistogram(INTER_TOKEN_BUCKETS)
        cache = self.config.cache
        # vLLM's cache_config_info labels (its CacheConfig's fields, as strings) that this engine has
        self.cache_config_info = {
            "block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks": str(self.runner.num_blocks),
            "num_gpu_blocks_override": str(cache.num_gpu_blocks_override)}
        layout = self.runner.kv_layout
        kv_tokens = self.runner.num_blocks * self.config.cache.block_size
        if layout.releases_pages:  # a block holds layout.slots layers: tokens of all of them are fewer
            layers = len(self.model.config.attention_layer_ids)
            kv_tokens = f"{kv_tokens * layout.slots // layers} tokens of every layer"
        else:
            kv_tokens = f"{kv_tokens} tokens"
        graphs = self.runner.decode_graphs.buckets if self.runner.decode_graphs else "off"
        self.load_summary = loaded.summary + [
            f"KV cache: {self.runner.num_blocks} blocks x {self.config.cache.block_size} = {kv_tokens} "
            f"({str(self.runner.kv_cache.dtype).removeprefix('torch.')}); "
            f"max_model_len {self.max_model_len}; prefix caching "
            f"{'on' if self.config.cache.enable_prefix_caching else 'off'}; CUDA graphs {graphs}",
        ]
        if layout.releases_pages:
            self.load_summary[-1] += "; " + layout.describe()
        slots = self.runner.state_slots
        if slots is not None:
            self.load_summary[-1] += (f"; linear-attention states: {slots.count} slots"
                                      f"{f' + {slots.prefix.count} prefix states' if slots.prefix is not None else ''} x "
                                      f"{slots.slot_bytes / 2**20:.2f} MiB "
                                      f"({len(self.model.linear_attention_layers())} layers)")
        logger.info(self.load_summary[-1])
        if self.lora is not None:
            for i, (name, path) in enumerate(self.config.lora.parsed_modules()):
                self.add_lora(LoRARequest(name, i + 1, path))
            lora = self.config.lora
            self.load_summary.append(f"LoRA: up to {lora.max_loras} adapter(s) per step, rank <= {lora.max_lora_rank}, "
                                     f"on {len(self.lora.layers)} linears; loaded: "
                                     f"{', '.join(r.lora_name for r in self.lora.list()) or 'none'}")
            logger.info(self.load_summary[-1])

    # ---------------------------------------------------------------- LoRA adapters

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None

    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled: start the engine with enable_lora "
                             "(LLM(enable_lora=True), --enable-lora)")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and checks an adapter (ValueError naming the file / tensor for one that cannot be served); True if
        newly added, False if its lora_int_id was already loaded."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter (requests already using it finish with it); False if no adapter has that id."""
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self._lora_manager().list() if self.lora is not None else []

    def check_lora_request(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The registered adapter a request runs with (one not loaded yet is loaded from its lora_path), or None for
        the base; ValueError when LoRA is off or the adapter is unknown or cannot be loaded."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(f"lora_request must be None unless LoRA is enabled (LLM(enable_lora=True), "
                             f"--enable-lora), got {_short(lora_request)}")
        return self.lora.resolve(lora_request)

    # ---------------------------------------------------------------- requests

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (a 400 for the server) when a request cannot be served: a RequestError naming the
        field for the checks the CLI and the server share."""
        params.check_across_fields()  # assignment checks each field alone (n = 2 at temperature 0 is refused here)
        # no max_tokens here: an output that reaches the context ends there (finish_reason "length")
        check_fits_context(len(prompt_token_ids), self.max_model_len, "prompt_token_ids")
        vocab = self.vocab_size
        check_token_ids(prompt_token_ids, vocab, "prompt_token_ids")
        check_token_ids([t for t, _ in params.logit_bias], vocab, "logit_bias")
        check_token_ids(params.allowed_token_ids or (), vocab, "allowed_token_ids")
        # vLLM's check too: an id past the logits can never be sampled, so the request ran on past its stop
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        tokenized_bad_words(params, self.tokenizer, vocab)
        for name in ("logprobs", "prompt_logprobs"):  # more alternatives than tokens failed inside the step
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name} is {getattr(params, name)}; the vocabulary has {vocab} tokens")
            if (getattr(params, name) or 0) < 0:  # vLLM's -1 (LLM turns it into the vocabulary's size): topk(-1) failed
                raise ValueError(f"{name} is {getattr(params, name)}: the engine takes a count (LLM.generate reads -1 "
                                 f"as the whole vocabulary, {vocab} tokens)")
        if params.stop and self.tokenizer is None:  # they match text, which such a model has none of
            raise ValueError("stop strings need the model's tokenizer, and this checkpoint has none: "
                             "use stop_token_ids")
        if params.structured_output is not None:
            self.grammar_backend().compile(params.structured_output)  # cached: add_request reuses it

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output compiler for this model's tokenizer and vocabulary (built once; any thread)."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                if self.tokenizer is None:
                    raise StructuredOutputError("structured output needs the model's tokenizer, and this "
                                                "checkpoint has none")
                self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size,
                                                       sorted(self.eos_token_ids))
            return self._grammar_backend

    def warm_grammar_backend(self) -> threading.Thread | None:
        """Builds the structured-output backend and the JSON-object grammar on a background thread, so the
        first structured request does not pay for them (0.8-1.2 s on the embedded model); None without a
        tokenizer."""
        if self.tokenizer is None:
            return None

        def build():
            try:
                self.grammar_backend().compile(StructuredOutput(json_object=True))
            except StructuredOutputError as exc:  # a request will report it; nothing to warm
                logger.info("structured output unavailable: %s", exc)

        # not a daemon: the interpreter waits for it at exit, as a process that ended while xgrammar was still
        # compiling aborted ("terminate called without an active exception", rc 134) after a failed start
        thread = threading.Thread(target=build, name="radiance-grammar-warmup", daemon=False)
        thread.start()
        return thread

    @staticmethod
    def check_one_sequence(params: SamplingParams) -> None:
        """ValueError for n > 1: a request is one sequence here, and n > 1 was served as one completion
        without a word. Callers expand n into n requests (LLM.generate, the server: seed + i each)."""
        if params.n != 1:
            raise ValueError(f"n is {params.n}, but the engine serves one completion per request: send n requests "
                             f"with n=1 (LLM.generate and the server expand n this way)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        # the request's own copy (vLLM's engine clones too): SamplingParams are mutable, and a caller that changes
        # its object for the next request must not change this one (every field is immutable: a shallow copy)
        params = copy.copy(params) if params is not None else SamplingParams()
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_one_sequence(params)
        self.check_request(prompt_token_ids, params)
        lora_request = self.check_lora_request(lora_request)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(generator_seed(int(params.seed)))
        seq = Sequence(request_id, prompt_token_ids, params, self._arrivals, generator)
        if params.structured_output is not None:
            seq.grammar = self.grammar_backend().matcher(params.structured_output)
        if params.min_tokens:
            seq.min_tokens_bans = self._ending_tokens(params)
        if params.has_bad_words:
            seq.bad_words = BadWords(tokenized_bad_words(params, self.tokenizer, self.vocab_size))
        # detokenize=False (vLLM's; no stop strings then): no decoding per token, the text stays ""
        detokenizer = IncrementalDetokenizer(self.tokenizer if params.detokenize else None, seq.prompt_token_ids,
                                             params.skip_special_tokens, params.stop,
                                             include_stop=params.include_stop_str_in_output)
        if lora_request is not None:  # the last step that can fail (the adapter removed meanwhile)
            seq.lora_fingerprint = self.lora.acquire(lora_request.lora_int_id)
            seq.lora_request, seq.lora_int_id = lora_request, lora_request.lora_int_id
        # registered only once nothing can fail: a half-added request kept its id in use
        self._arrivals += 1
        self.sequences[request_id] = seq
        self.detokenizers[request_id] = detokenizer
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_token_ids)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_int_id and self.lora is not None:
            self.lora.release(seq.lora_int_id)
            seq.lora_int_id = 0  # released once, whatever removes it next

    def _ending_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens that end an output (min_tokens bans them): the stop_token_ids, and EOS unless ignored; one
        outside the vocabulary can never be sampled, so it needs no ban (and would not index the logits)."""
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return tuple(sorted(t for t in ids if 0 <= t < self.vocab_size))

    def abort_request(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self._release_lora(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        self._aborted.append(self._output(seq))
        self.detokenizers.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[StepOutput]:
        outputs = list(self._aborted)
        self._aborted.clear()
        self.speculator.propose()
        scheduled = self.scheduler.schedule(admit=self.ahead.admits())
        handle = self.ahead.take(scheduled)
        if not scheduled:
            return outputs
        self._note_scheduled(scheduled)
        if handle is None:
            handle = self.runner.launch(scheduled)
        if handle.sampled and handle.token_ids is None:
            # structured output: the masks needed the tokens the host read since the forward was queued
            self.runner.sample(handle)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if not s.seq.num_draft_tokens:  # a speculative step commits once its drafts are checked
                self.block_manager.commit(s.seq)
        if self.overlap_decode:
            self.ahead.launch(handle, scheduled)
        sampled, result = self.runner.finish(handle)
        now = time.monotonic()  # this step's tokens are on the host
        gaps = []
        row = 0
        for s in sampled:
            seq = s.seq
            if seq.num_draft_tokens:
                drafted = seq.num_draft_tokens
                self.speculator.verify(seq, result.token_ids[row:row + 1 + drafted], self._append)
                row += 1 + drafted
            else:
                logprob = None
                if result.logprobs[row] is not None:
                    chosen, top, rank = result.logprobs[row]
                    logprob = TokenLogprob(result.token_ids[row], chosen, top, rank)
                self._append(seq, result.token_ids[row], logprob)
                row += 1
            self._note_tokens(seq, now, gaps)
            outputs.append(self._output(seq))
            if seq.is_finished:
                self.scheduler.remove(seq)
                self._release_lora(seq)
                self.sequences.pop(seq.request_id, None)
                self.detokenizers.pop(seq.request_id, None)
        self.inter_token_latency.observe_many(gaps)
        return outputs

    def _note_scheduled(self, scheduled: list[ScheduledSequence]) -> None:
        """The step's statistics: the tokens it computes, and the first scheduling of each sequence (a preempted
        one, scheduled again, keeps its first: its wait in the queue ended then)."""
        self.iteration_tokens.observe(sum(s.num_new_tokens for s in scheduled))
        now = time.monotonic()
        for s in scheduled:
            if s.seq.times.first_scheduled is None:
                s.seq.times = RequestTimes(first_scheduled=now)

    @staticmethod
    def _note_tokens(seq: Sequence, now: float, gaps: list[float]) -> None:
        """A step gave `seq` its next token(s) at `now`: one inter-token gap per step (into `gaps`), as vLLM's (a
        speculative step's several tokens are one gap; a preempted request's recompute is in its gap, as its client
        sees). Per sequence per step: the constructor, not dataclasses.replace (half the host time)."""
        times = seq.times
        if times.last_token is not None:
            gaps.append(now - times.last_token)
        seq.times = RequestTimes(times.first_scheduled, now if times.first_token is None else times.first_token, now)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        seq.append_token(token_id, logprob)
        self.generation_tokens_total += 1
        p = seq.params
        hit_stop_string = False
        # as in vLLM, nothing stops the output before min_tokens (EOS and stop tokens are banned until then), and
        # a stop string counts only where it ends in the text of a later token
        past_min = seq.num_output_tokens > p.min_tokens
        stops = self._stops(seq, token_id)
        if p.include_stop_str_in_output or not stops:
            hit_stop_string = self.detokenizers[seq.request_id].add_token(token_id, check_stop=past_min)
        detokenizer = self.detokenizers[seq.request_id]
        grammar_done = False
        if seq.grammar is not None:
            accepted = seq.grammar.accept(token_id)
            if not accepted:  # only when the mask allowed nothing: end rather than go on unconstrained
                logger.warning("request %s: token %d breaks its structured output; finishing it", seq.request_id,
                               token_id)
            grammar_done = not accepted or seq.grammar.finished
        reason = None
        if stops or hit_stop_string or grammar_done:
            reason = "stop"
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        seq.text = detokenizer.finish() if reason else detokenizer.visible_text()
        if reason:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            seq.stop_reason = self._stop_reason(seq, token_id, stops, detokenizer)

    def _stops(self, seq: Sequence, token_id: int) -> bool:
        """Whether the token just appended ends the output: EOS (unless ignore_eos) or a stop_token_ids one,
        once min_tokens are out. As in vLLM, its id ends token_ids but its text joins text only with
        include_stop_str_in_output, even where special tokens are kept (the server asks for it where its
        harmony parser reads gpt-oss's <|call|> / <|return|>)."""
        p = seq.params
        ends = (not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids
        return ends and seq.num_output_tokens >= p.min_tokens

    def _stop_reason(self, seq: Sequence, token_id: int, stopped_by_token: bool, detokenizer) -> int | str | None:
        """vLLM's order: EOS (None) before a stop_token_ids id, then the stop string matched."""
        if stopped_by_token:
            return None if not seq.params.ignore_eos and token_id in self.eos_token_ids else token_id
        return detokenizer.matched_stop

    @staticmethod
    def _output(seq: Sequence) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, text=seq.text,
            token_ids=seq.output_token_ids, logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason, finished=seq.is_finished, num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob, stop_reason=seq.stop_reason, times=seq.times)

    def _lora_adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapter names of the running and of the waiting requests. The server reads stats() from its event loop
        while this engine's thread changes the queues: each is copied in one C-level call first (a Python loop over a
        deque being changed would raise)."""
        def names(seqs) -> tuple[str, ...]:
            return tuple(dict.fromkeys(s.lora_request.lora_name for s in seqs if s.lora_request is not None))
        return names(list(self.scheduler.running)), names(tuple(self.scheduler.waiting))

    def stats(self) -> EngineStats:
        lora = {}
        if self.lora is not None:
            running, waiting = self._lora_adapters()
            lora = dict(max_lora=self.config.lora.max_loras, running_lora_adapters=running,
                        waiting_lora_adapters=waiting)
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage(), num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            draft_tokens_total=self.draft_tokens, accepted_draft_tokens_total=self.accepted_draft_tokens,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits,
            iteration_tokens=self.iteration_tokens.snapshot(),
            inter_token_latency=self.inter_token_latency.snapshot(), cache_config=dict(self.cache_config_info), **lora)

    # counters the stats and tests read, kept by the parts that count them
    @property
    def overlapped_steps(self) -> int:
        return self.ahead.overlapped_steps

    @property
    def draft_tokens(self) -> int:
        return self.speculator.draft_tokens

    @property
    def accepted_draft_tokens(self) -> int:
        return self.speculator.accepted_draft_tokens
