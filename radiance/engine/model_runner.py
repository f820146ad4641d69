"""Turns a scheduled step into tensors, runs the model over the paged KV cache and samples.

Decode-only steps on CUDA replay a CUDA graph captured for the smallest batch bucket that fits, single-sequence
prefills one captured per token bucket (`step_graphs`; not a hybrid model's), and other steps up to the largest
piecewise bucket (several sequences prefilling, prefill chunks next to decodes) replay a forward captured in pieces
between its prefill-attention launches (and a hybrid model's conv and delta-rule launches: `piecewise_graphs`);
larger steps, and everything on the CPU, run eagerly.
`launch` queues a step (sampling included; the sampled ids start their copy home behind an event) and
`finish` waits for that step alone, so the engine can queue the next decode step in between. Steps with
structured output sample separately (`sample`), once the host has the tokens their masks depend on, so
their forward can still be queued ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from radiance.config import EngineConfig
from radiance.engine.kv_cache import (allocate_kv_cache, check_kv_capacity, check_max_model_len, kv_cache_dtype,
                                      kv_capacity, num_kv_blocks)
from radiance.engine.kv_layout import KvLayout
from radiance.engine.outputs import TokenLogprob
from radiance.engine.piecewise_graphs import PiecewiseGraphs
from radiance.engine.scheduler import ScheduledSequence
from radiance.engine.state_cache import StepStates, allocate_state_cache, has_recurrent_state
from radiance.engine.step_graphs import DecodeGraphs, PrefillGraphs, decode_num_splits
from radiance.engine.step_inputs import StepInputs
from radiance.engine.structured_output import fill_allowed_token_words
from radiance.layers.attention import AttentionMetadata
from radiance.layers.rotary import RotaryEmbedding
from radiance.layers.sampler import (LogitAdjustment, OutputCounts, SamplerOutput, SamplingRow, read_samples,
                                    sample_on_device, small_tensor_to, ranked_token_logprobs)

logger = logging.getLogger(__name__)

PROMPT_SCORE_ROWS = 512  # prompt positions per logits slice when scoring prompts (x vocab x 4 bytes)


def logit_adjustment(seq, vocab: int, device: torch.device, banned: tuple[int, ...] = ()) -> LogitAdjustment:
    """A sequence's logit bias, penalties, `banned` tokens and allowed_token_ids mask, its output counts brought up
    to the tokens the host has."""
    p = seq.params
    if p.penalizes:
        if seq.output_counts is None:
            seq.output_counts = OutputCounts(vocab, device,
                                             seq.prompt_token_ids if p.repetition_penalty != 1.0 else None)
        seq.output_counts.catch_up(seq.token_ids[seq.num_prompt_tokens + seq.output_counts.counted:])
    if p.allowed_token_ids is not None and seq.disallowed is None:  # built once per sequence, kept on the device
        seq.disallowed = torch.ones(vocab, dtype=torch.bool, device=device)
        seq.disallowed[small_tensor_to(list(p.allowed_token_ids), device)] = False
    return LogitAdjustment(p.logit_bias, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                           seq.output_counts if p.penalizes else None, banned=banned, disallowed=seq.disallowed)


def sampling_rows(sampled: list[ScheduledSequence], vocab: int, device: torch.device,
                  pending: bool) -> list[SamplingRow]:
    """One row per logits row: a sequence's last token's, after one per draft token before it. A row below its
    min_tokens bans the tokens that would end the output; it counts the output tokens before its own position
    (the drafts before it, and the token still on the device when `pending`). Rows with nothing to adjust
    take the plain path."""
    rows = []
    for s in sampled:
        seq, p = s.seq, s.seq.params
        before = seq.num_output_tokens - seq.num_draft_tokens + pending
        for j in range(1 + seq.num_draft_tokens):
            banned = seq.bans_after(before + j) if p.min_tokens or seq.bad_words is not None else ()
            adjust = logit_adjustment(seq, vocab, device, banned) if p.adjusts_logits or banned else None
            rows.append(SamplingRow(p.temperature, p.top_p, p.top_k, p.min_p, seq.generator, p.logprobs, adjust))
    return rows


def _lora_row_slots(scheduled: list[ScheduledSequence], q_lens: list[int]) -> np.ndarray:
    """The LoRA slot of each row of a step (Sequence.lora_slot, -1 for the base): one per sequence's new token."""
    slots = np.fromiter((s.seq.lora_slot for s in scheduled), dtype=np.int64, count=len(scheduled))
    return np.repeat(slots, q_lens) if any(n != 1 for n in q_lens) else slots


@dataclass
class StepHandle:
    """A step queued on the device: the sequences that sample, their sampling rows, the logits and
    the sampled ids (device; None until sampled), and the ids' copy into pinned host memory with the
    event that marks it done. Reading that copy waits for this step only, not for steps queued after it."""

    sampled: list[ScheduledSequence]
    rows: list[SamplingRow]
    logits: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None  # pinned (CUDA) or the ids themselves (CPU)
    ready: torch.cuda.Event | None = None
    host_rows: list[int] | None = None  # which rows of host_ids are this handle's (after select)

    def select(self, keep: list[int]) -> "StepHandle":
        """The same step restricted to the sampled rows at positions `keep` (in that order)."""
        if keep == list(range(len(self.sampled))):
            return self
        idx = small_tensor_to(keep, self.logits.device)
        if self.token_ids is None:  # not sampled yet (ModelRunner.sample)
            return StepHandle([self.sampled[i] for i in keep], [], self.logits[idx])
        rows = [self.host_rows[i] for i in keep] if self.host_rows is not None else keep
        return StepHandle([self.sampled[i] for i in keep], [self.rows[i] for i in keep], self.logits[idx],
                          self.token_ids[idx], self.host_ids, self.ready, rows)

    def read_ids(self) -> list[int]:
        """The sampled ids on the host, waiting for this step's copy only."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.host_rows is None:
            return self.host_ids[:len(self.rows)].tolist()
        ids = self.host_ids.tolist()
        return [ids[i] for i in self.host_rows]


def _uncapturable_module(model) -> str | None:
    """The name of a module whose forward a CUDA graph cannot capture (it says so with `capturable()`)."""
    for name, module in model.named_modules():
        capturable = getattr(module, "capturable", None)
        if capturable is not None and not capturable():
            return name
    return None


def _serve_rotary_context(model, max_model_len: int) -> None:
    """Tells the rotary embeddings the served context (LongRoPE picks its short or long factors by it) and says
    which LongRoPE set serves."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.serve_context(max_model_len)
            if (module.scaling or {}).get("rope_type") == "longrope":
                original = module.scaling["original_max_position_embeddings"]
                which = (f"long factors (max_model_len {max_model_len} > the pretraining context {original}; "
                         f"--max-model-len {original} serves short prompts with the short ones)"
                         if module.long_factors else f"short factors (max_model_len {max_model_len} <= {original})")
                logger.info("LongRoPE rotary: %s", which)


class ModelRunner:
    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype, lora_context=None):
        """`lora_context`: the radiance.lora.LoraStepContext of the model's LoraLinears (LoRA on), whose per-row slot
        buffer each step fills before its forward (eager or a graph replay)."""
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        arch = model.config
        kv_dtype = kv_cache_dtype(device, dtype, config.cache.kv_cache_dtype)
        # a hybrid model's linear-attention states, one slot per running sequence: before the KV cache is sized on
        # the memory left
        self.state_slots, states_bytes = None, 0
        if has_recurrent_state(model):
            prefix_states = config.cache.prefix_states or 0  # serving_config fitted it
            self.state_slots = allocate_state_cache(model, config.scheduler.max_num_seqs, device, dtype, prefix_states)
            states_bytes = (self.state_slots.count + prefix_states) * self.state_slots.slot_bytes
        self.kv_layout = KvLayout.of(arch, config.cache.hybrid_kv_cache)  # the engine's startup line describes it
        self.num_blocks = num_kv_blocks(model, config.cache, config.scheduler, device, kv_dtype, self.kv_layout,
                                        states_bytes)
        self.max_model_len = self._max_model_len(config.model.max_model_len, arch.context_length)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        _serve_rotary_context(model, self.max_model_len)
        self.kv_cache = allocate_kv_cache(model, self.num_blocks, self.block_size, device, kv_dtype, self.kv_layout)
        self.inputs = StepInputs(self.block_size, self.kv_layout.num_groups, device)
        self.lora_context = lora_context
        if lora_context is not None:  # rows of the largest step: a whole unchunked prompt, or every sequence's drafts
            sched = config.scheduler
            lora_context.allocate(max(sched.max_num_batched_tokens, self.max_model_len,
                                      sched.max_num_seqs * (1 + config.speculative.ngram_draft_tokens)), device)
        # pinned landing buffers of the sampled ids, used in turn (like the graph inputs' staging sets)
        max_rows = max(config.scheduler.max_num_seqs, 1 + config.speculative.ngram_draft_tokens)  # sampled rows
        pin = device.type == "cuda"
        self.h_ids = [torch.zeros(max_rows, dtype=torch.long, pin_memory=pin) for _ in range(3)]
        self._readback = 0
        self.h_masks: list[torch.Tensor] = []  # pinned structured-output masks, allocated on first use (_mask_words)
        self._mask_turn = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.base_decode_graphs: DecodeGraphs | None = None  # LoRA on: the decode graphs without the deltas
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self._pool = None  # the memory pool the prefill and piecewise graphs share (one forward runs at a time)
        uncapturable = _uncapturable_module(model)
        if device.type == "cuda" and not config.runner.enforce_eager and uncapturable:
            logger.warning("CUDA graphs off: %s syncs with the host in its forward (e.g. experts not on the "
                           "W4A8 kernel; --quantization mxfp4 puts them there)", uncapturable)
        if device.type == "cuda" and not config.runner.enforce_eager and not uncapturable:
            self.capture_decode_graphs()
            self._capture_prefill_graphs()
            self._capture_piecewise_graphs()
            if config.kernel.numerics_check:  # graph replays run no Python, so no check can run inside them
                sizes = (self.prefill_graphs.sizes if self.prefill_graphs else []) + \
                    (self.piecewise.sizes if self.piecewise else [])
                logger.warning("numerics check covers eager steps only (above %d tokens, decode batches above %d); "
                               "add --enforce-eager to check every step", max(sizes, default=0),
                               self.decode_graphs.buckets[-1])

    def _max_model_len(self, requested: int | None, context: int) -> int:
        """The requested length or the model's context. A requested one above the context is refused (load_model
        checks it first, before the weights load; this covers a runner built on a model of its own), and so is
        one above what the KV cache holds (as vLLM refuses it). Not requested (None), the model's context is
        lowered to what the KV cache holds, with a warning, so a bare `radiance serve` runs on a small machine."""
        check_max_model_len(requested, context)
        step_tokens = self.config.scheduler.max_num_batched_tokens
        check_kv_capacity(requested, self.num_blocks, self.block_size, self.config.cache, self.device.type,
                          kv_capacity(self.num_blocks, self.block_size, self.kv_layout, step_tokens, requested))
        capacity = kv_capacity(self.num_blocks, self.block_size, self.kv_layout, step_tokens, context)
        if requested is not None:
            return requested
        if capacity < context:
            logger.warning("max_model_len lowered to %d from the model's context of %d (the KV cache holds no "
                           "more; --gpu-memory-utilization / --cpu-kv-cache-bytes / --kv-cache-dtype fp8 raise it)",
                           capacity, context)
            return capacity
        return context

    # ---------------------------------------------------------------- inputs

    def _to_device(self, array, dtype) -> torch.Tensor:
        return torch.as_tensor(array, dtype=dtype).to(self.device, non_blocking=True)

    # ---------------------------------------------------------------- execution

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSequence], next_tokens: torch.Tensor | None = None) -> StepHandle:
        """Queues one step on the device, sampling included, without waiting for it (`finish` waits). A step
        with a structured-output sequence (any Sequence.samples_after_host) comes back unsampled (token_ids None):
        the caller runs `sample` once the host has accepted every earlier token into the sequences' grammars.

        `next_tokens` (device, one per sequence) makes it the decode step that follows a launched one
        whose tokens the host has not read yet: each sequence advances by that token at position
        seq.num_computed_tokens (whose slot the caller has allocated)."""
        tokens, positions, slots, q_lens, kv_lens, tables = self.inputs.prepare(scheduled, next_tokens is not None)
        tokens = next_tokens if next_tokens is not None else tokens
        is_decode = all(n == 1 for n in q_lens)
        batch = len(scheduled)
        if self.lora_context is not None:  # before the forward, eager or replayed: its LoraLinears read the slots
            self.lora_context.begin_step(_lora_row_slots(scheduled, q_lens))
        states = StepStates.of([s.seq for s in scheduled], q_lens) if self.state_slots is not None else None
        decode_graphs = self._decode_graphs_for_step()
        if is_decode and decode_graphs and decode_graphs.serves(batch):
            hidden = decode_graphs.replay(tokens, positions, slots, kv_lens, tables, states and states.slots)
        elif (batch == 1 and not is_decode and next_tokens is None and self.prefill_graphs
              and self.prefill_graphs.serves(q_lens[0])):
            hidden = self.prefill_graphs.replay(tokens, positions, slots, kv_lens[0], tables)
        elif not is_decode and next_tokens is None and self.piecewise and self.piecewise.serves(len(positions), batch):
            hidden = self.piecewise.replay(tokens, positions, slots, q_lens, kv_lens, tables, states)
        else:
            cu = np.zeros(batch + 1, dtype=np.int32)
            cu[1:] = np.cumsum(q_lens)
            meta = AttentionMetadata(
                slot_mapping=self._to_device(slots[0], torch.int64),
                block_tables=self._to_device(tables[0], torch.int32),
                context_lens=self._to_device(kv_lens, torch.int32),
                cu_seqlens_q=self._to_device(cu, torch.int32),
                q_lens=q_lens, kv_lens=kv_lens, is_decode=is_decode,
                decode_splits=decode_num_splits(batch, self.model.config.num_kv_heads),
                slots_valid=bool(slots.size == 0 or slots.min() >= 0),
                kv_first_blocks=self.inputs.first_blocks_in_order(tables[0], kv_lens))
            if states is not None:
                meta.state_slots = self._to_device(states.slots, torch.int64)
                meta.continues_state, meta.state_saves = states.continues, states.saves
                meta.continues_state_device = self._to_device(states.continues, torch.int32)
                if not is_decode and self.device.type == "cuda":
                    meta.delta_chunks = states.chunk_table(q_lens, self.device)
            meta.other_groups = tuple(
                dataclasses.replace(meta, slot_mapping=self._to_device(slots[g], torch.int64),
                                    block_tables=self._to_device(tables[g], torch.int32),
                                    kv_first_blocks=self.inputs.first_blocks_in_order(tables[g], kv_lens))
                for g in range(1, len(tables)))
            token_tensor = tokens if isinstance(tokens, torch.Tensor) else self._to_device(tokens, torch.long)
            hidden = self.model(token_tensor, self._to_device(positions, torch.long), meta)
        if self.lora_context is not None:
            self.lora_context.end_step()
        if next_tokens is None and any(s.seq.prompt_logprobs is not None for s in scheduled):
            self._score_prompts(scheduled, q_lens, hidden)
        sampling = list(range(batch)) if next_tokens is not None else [i for i, s in enumerate(scheduled) if s.samples]
        if not sampling:
            return StepHandle([], [])
        if is_decode and len(sampling) == batch:
            logits = self.model.compute_logits(hidden, fp32=False)  # one row per sequence already
        else:  # each sampling sequence's last row, and the rows of its draft tokens before it
            last_rows = np.cumsum(q_lens) - 1
            rows = [r for i in sampling for r in range(last_rows[i] - scheduled[i].seq.num_draft_tokens, last_rows[i] + 1)]
            logits = self.model.compute_logits(hidden[torch.as_tensor(rows, device=self.device)], fp32=False)
        handle = StepHandle([scheduled[i] for i in sampling], [], logits)
        if any(s.seq.samples_after_host for s in handle.sampled):
            return handle  # the engine samples it once the host has every token before it (masks, bad words need them)
        return self.sample(handle, pending=next_tokens)

    @torch.inference_mode()
    def sample(self, handle: StepHandle, pending: torch.Tensor | None = None) -> StepHandle:
        """Queues the sampling of a launched step's logits and the copy home of its ids (behind an event).
        `pending` (device, one per row): each sequence's newest token where the host does not have it yet."""
        seqs = [s.seq for s in handle.sampled for _ in range(1 + s.seq.num_draft_tokens)]  # one per logits row
        logits = handle.logits
        rows = sampling_rows(handle.sampled, logits.shape[-1], logits.device, pending is not None)
        constrained = [(row, seq.grammar) for row, seq in zip(rows, seqs) if seq.grammar is not None]
        if constrained:  # every constrained sequence's mask in one transfer
            words = self._mask_words(len(constrained), logits.shape[-1])
            fill_allowed_token_words([grammar for _, grammar in constrained], words)
            if logits.is_cuda:
                words = words.to(logits.device, non_blocking=True)
            for (row, _), allowed in zip(constrained, words):
                row.adjust.allowed = allowed
        # the logits stay in the model's dtype (fp32 copies where a row has a bias, penalties or a mask)
        token_ids = sample_on_device(logits, rows, pending=pending)
        host_ids, ready = token_ids, None
        if token_ids.is_cuda:  # start the copy home now, ahead of anything queued after this step
            self._readback = (self._readback + 1) % len(self.h_ids)
            host_ids = self.h_ids[self._readback][:len(rows)]
            host_ids.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        handle.rows, handle.token_ids, handle.host_ids, handle.ready = rows, token_ids, host_ids, ready
        return handle

    def _mask_words(self, rows: int, vocab: int) -> torch.Tensor:
        """Host int32 words for `rows` structured-output masks. On CUDA two pinned buffers serve in turn: one is
        reused two samplings later, after the host has waited on the sampling between (so on its copy)."""
        width = (vocab + 31) // 32
        if self.device.type != "cuda":
            return torch.empty(rows, width, dtype=torch.int32)
        if not self.h_masks or self.h_masks[0].shape[0] < rows:
            self.h_masks = [torch.empty(len(self.h_ids[0]), width, dtype=torch.int32, pin_memory=True)
                            for _ in range(2)]
        self._mask_turn ^= 1
        return self.h_masks[self._mask_turn][:rows]

    def _score_prompts(self, scheduled: list[ScheduledSequence], q_lens: list[int], hidden: torch.Tensor) -> None:
        """SamplingParams.prompt_logprobs: the row of prompt position p scores prompt token p + 1. Appends
        each sequence's new positions to seq.prompt_logprobs (a recompute after preemption skips those it
        has); logits in slices of PROMPT_SCORE_ROWS rows, read back at once (these requests wait anyway)."""
        first_row = 0
        for s, n in zip(scheduled, q_lens):
            seq, start = s.seq, s.seq.num_computed_tokens
            want = seq.params.prompt_logprobs
            if want is not None:
                lo = max(start, len(seq.prompt_logprobs) - 1)
                end = min(start + n, seq.num_prompt_tokens - 1)
                for a in range(lo, end, PROMPT_SCORE_ROWS):
                    b = min(a + PROMPT_SCORE_ROWS, end)
                    logits = self.model.compute_logits(hidden[first_row + a - start:first_row + b - start])
                    targets = seq.token_ids[a + 1:b + 1]
                    for token, (chosen, top, rank) in zip(targets, ranked_token_logprobs(logits, targets, want)):
                        seq.prompt_logprobs.append(TokenLogprob(token, chosen, top, rank))
            first_row += n

    def finish(self, handle: StepHandle) -> tuple[list, SamplerOutput | None]:
        """Waits for a launched step (not for steps queued after it) and reads its sampled tokens (and
        logprobs)."""
        if not handle.sampled:
            return [], None
        return handle.sampled, read_samples(handle.logits, handle.read_ids(), handle.rows)

    # ---------------------------------------------------------------- CUDA graphs

    def _lora_capturing(self):
        """LoRA deltas on while graphs are captured (a replay computes them for whatever adapters a step has)."""
        return self.lora_context.capturing() if self.lora_context is not None else contextlib.nullcontext()

    def capture_decode_graphs(self) -> None:
        """(Re)capture the decode graphs (a re-capture bakes in changed kernel tilings: tools/). With LoRA on, a
        second set without the LoRA deltas serves the decode steps in which no sequence has an adapter, at the
        base model's cost (the wrapped linears keep its fused GLU and split-sum paths there)."""
        max_batch = min(self.config.runner.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)
        arch = self.model.config
        groups = self.kv_layout.num_groups
        states = self.state_slots is not None
        self.decode_graphs = DecodeGraphs(max_batch, self.max_blocks_per_seq, arch.num_kv_heads, self.device, groups,
                                          states)
        with self._lora_capturing():
            pool = self.decode_graphs.capture(self.model)
        if self.lora_context is not None:  # one forward runs at a time: both sets share the pool
            self.base_decode_graphs = DecodeGraphs(max_batch, self.max_blocks_per_seq, arch.num_kv_heads,
                                                   self.device, groups, states)
            self.base_decode_graphs.capture(self.model, pool)
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batches %s%s", self.decode_graphs.buckets,
                    " (with and without LoRA deltas)" if self.lora_context is not None else "")

    def _decode_graphs_for_step(self) -> DecodeGraphs | None:
        """The decode graphs for the step whose LoRA slots were just written: without the deltas where no row has an
        adapter (LoraStepContext.compute is off)."""
        if self.base_decode_graphs is not None and not self.lora_context.compute:
            return self.base_decode_graphs
        return self.decode_graphs

    def _capture_prefill_graphs(self) -> None:
        """The single-sequence prefill graphs of `RunnerConfig.prefill_graph_tokens`, up to the step's token limit."""
        limit = min(self.max_model_len, self.config.scheduler.max_num_batched_tokens)
        sizes = set(self.config.runner.prefill_graph_buckets(getattr(self.model.config, "moe", None) is not None))
        drafts = self.config.speculative.ngram_draft_tokens
        if drafts:  # a speculative step checks 1 + drafts tokens of one sequence: a small bucket of its own
            sizes.add(1 << drafts.bit_length())
        sizes = sorted({t for t in sizes if 0 < t <= limit})
        if not sizes:
            return
        self.prefill_graphs = PrefillGraphs(sizes, self.max_blocks_per_seq, self.device, self.kv_layout.num_groups)
        with self._lora_capturing():
            self._pool = self.prefill_graphs.capture(self.model, self._pool)
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for single-sequence prefills of up to %s tokens", sizes)

    def _capture_piecewise_graphs(self) -> None:
        """The piecewise forwards (`RunnerConfig.piecewise_graph_tokens` buckets) for the steps no whole-step
        graph serves, of up to max_num_seqs sequences."""
        limit = min(self.config.scheduler.max_num_batched_tokens,
                    self.config.scheduler.max_num_seqs * self.max_model_len)
        sizes = self.config.runner.piecewise_graph_buckets(getattr(self.model.config, "moe", None) is not None)
        sizes = sorted({t for t in sizes if 0 < t <= limit})
        if not sizes:
            return
        dev, arch, seqs = self.device, self.model.config, self.config.scheduler.max_num_seqs
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
        self.piecewise = PiecewiseGraphs(sizes, seqs, self.max_blocks_per_seq, (arch.num_heads, arch.head_dim),
                                         self.dtype, dev, self.kv_layout.num_groups,
                                         arch.linear_attention if self.state_slots is not None else None)
        with self._lora_capturing():
            self._pool = self.piecewise.capture(self.model, self._pool)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # the eager warm-ups' cached blocks (the graphs keep their own pool)
        logger.info("captured piecewise CUDA graphs for steps of up to %d sequences and %s tokens in %.1f s "
                    "(%+.0f MiB reserved)", seqs, sizes, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(dev) - reserved) / 2**20)
