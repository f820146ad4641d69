"""The recurrent state of a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet): per layer, a conv tail
[rows, channels, kernel - 1] and a float32 state [rows, value heads, key_head_dim, value_head_dim]: one row (slot) per
running sequence (vLLM's mamba cache), then the rows of the prefix cache's states (PrefixStates). A sequence takes a
slot with its first KV blocks and gives it back with them (finished, aborted or preempted: a preempted sequence
recomputes from its tokens, so from a fresh state or a cached prefix's).

A state holds the whole prefix in a fixed size (2 MiB a layer for Qwen3.5-9B) and cannot be rewound: the engine
serves such models without speculative decoding, and a decode step queued ahead (overlap.DecodeAhead) is never
discarded — one that ran would have advanced the states — so while one is queued the scheduler admits nobody
(`DecodeAhead.pinned`; a request waits one decode step longer). Prefix caching keeps copies of the states at block
boundaries (PrefixStates). The decode graphs carry each
sequence's slot (step_graphs.DecodeGraphs; a padding row's slot -1 touches no state); other steps replay the
piecewise graphs (piecewise_graphs), which run each linear-attention layer's conv and delta rule eagerly between two
pieces with the step's slots, flags and saves (StepStates); the whole-step prefill graphs, which could not, are off
(`serving_config`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from radiance.config import EngineConfig
from radiance.kernels._triton.gated_delta_chunked import CHUNK, DeltaChunks, delta_chunks, serving_chunks
from radiance.layers.attention import StateSave

logger = logging.getLogger(__name__)


def has_recurrent_state(model) -> bool:
    return bool(getattr(model, "linear_attention_layers", lambda: [])())


class StateSlots:
    """The free slots of the state cache; slot numbers index each layer's state tensors. A slot is zeroed as it is
    handed out (`reset`): the CUDA decode kernels continue whatever state a slot holds, and a sequence may start in a
    one-token step (a one-token prompt, or a chunk of one beside decodes). `prefix`: the prefix cache's states, in
    the rows after the slots (None: no prefix caching)."""

    def __init__(self, count: int, reset=lambda slot: None, slot_bytes: int = 0, prefix: PrefixStates | None = None):
        self.count = count
        self.reset = reset
        self.slot_bytes = slot_bytes  # one sequence's states over every layer (bytes_per_slot)
        self.prefix = prefix
        self._free = list(range(count - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, zeroed: bool = True) -> int:
        """A free slot, zeroed unless the caller fills it (`zeroed=False`: a cached prefix's states go in)."""
        if not self._free:  # the scheduler runs at most max_num_seqs sequences, one slot each
            raise RuntimeError(f"all {self.count} linear-attention state slots are taken")
        slot = self._free.pop()
        if zeroed:
            self.reset(slot)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


class PrefixStates:
    """The prefix cache of a model with recurrent state (vLLM's mamba prefix caching, "align" mode): copies of a
    sequence's states at block boundaries, keyed by the digest of the block ending there (block_manager.block_hash:
    it stands for every token before, cache salt and adapter included): where a prefill chunk short of the prompt's
    end stops (the scheduler cuts those on a boundary; `save` copies the slot after the step), and inside a
    prompt's last chunk at its last whole 64-token chunk of the delta rule on a boundary (the step's launches write
    a `reserve`d row: AttentionMetadata.state_saves), so that the prompt's last tokens take no step of their own. A
    prefix hit needs the states at its end besides its KV blocks; admission copies them into the sequence's slot.
    Least recently used out first. Every copy is queued on the device's stream, so a save lands after the step
    that computed the states and a restore before the step that continues them."""

    def __init__(self, rows: range, copy):
        self.count = len(rows)
        self._copy = copy  # copy(src_row, dst_row) over every layer
        self._free = list(reversed(rows))
        self._row_of: OrderedDict[bytes, int] = OrderedDict()
        self.saves = self.restores = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._row_of

    @property
    def num_kept(self) -> int:
        return len(self._row_of)

    def save(self, slot: int, digest: bytes) -> None:
        """Keep the states in `slot` as the prefix ending with block `digest`. Equal digests mean equal tokens
        before them: one already kept is only touched."""
        if self.touch(digest):
            return
        row = self.reserve()
        if row is not None:
            self._copy(slot, row)
            self.publish(digest, row)

    def touch(self, digest: bytes) -> bool:
        """Whether the prefix ending with block `digest` is kept (then it is the most recently used)."""
        if digest in self._row_of:
            self._row_of.move_to_end(digest)
            return True
        return False

    def reserve(self) -> int | None:
        """A row for states a step writes (AttentionMetadata.state_saves): a free one, else the least recently used
        prefix's (None: every row is reserved by this step's other saves). Not found by lookups until `publish`."""
        if self._free:
            return self._free.pop()
        return self._row_of.popitem(last=False)[1] if self._row_of else None

    def publish(self, digest: bytes, row: int) -> None:
        """The reserved `row` holds the states of the prefix ending with block `digest` (or gives the row back when
        another sequence's step kept that prefix first)."""
        if digest in self._row_of:
            self.release(row)
            return
        self._row_of[digest] = row
        self.saves += 1

    def release(self, row: int) -> None:
        """A reserved row whose states were not kept."""
        self._free.append(row)

    def restore(self, digest: bytes, slot: int) -> None:
        """Copy the states kept for the prefix ending with block `digest` into `slot`."""
        self._row_of.move_to_end(digest)
        self._copy(self._row_of[digest], slot)
        self.restores += 1


class StepStates(NamedTuple):
    """A step's linear-attention inputs on the host: each sequence's state slot, whether it continues the state
    there (False: its first tokens), and the prefix cache's saves inside the step (step_state_saves)."""

    slots: list[int]
    continues: list[bool]
    saves: tuple[StateSave, ...]

    @classmethod
    def of(cls, seqs, q_lens: list[int]) -> StepStates:
        return cls([seq.state_slot for seq in seqs], [seq.num_computed_tokens > 0 for seq in seqs],
                   step_state_saves(seqs, q_lens))

    def chunk_table(self, q_lens: list[int], device: torch.device) -> DeltaChunks | None:
        """The chunk table of a CUDA prefill step's delta rule: always with saves (the chunked launches keep their
        states), else where the chunked form is the faster (serving_chunks); None: token by token."""
        return delta_chunks(q_lens, device) if self.saves else serving_chunks(q_lens, device)


def step_state_saves(seqs, q_lens: list[int]) -> tuple[StateSave, ...]:
    """AttentionMetadata.state_saves of a step computing q_lens[i] tokens of seqs[i]: their Sequence.state_save,
    with the chunk each starts in the step's table of 64-token chunks (gated_delta_chunked.delta_chunks)."""
    saves, first_chunk = [], 0
    for i, (seq, n) in enumerate(zip(seqs, q_lens)):
        if seq.state_save is not None:
            tokens, _, row = seq.state_save
            saves.append(StateSave(i, tokens, row, first_chunk + tokens // CHUNK))
        first_chunk += -(-n // CHUNK)
    return tuple(saves)


def bytes_per_slot(model, dtype: torch.dtype) -> int:
    """Bytes one sequence's states take over every linear-attention layer."""
    total = 0
    for layer in model.linear_attention_layers():
        la = layer.la
        conv = la.conv_channels * (la.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        total += conv + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
    return total


def allocate_state_cache(model, slots: int, device: torch.device, dtype: torch.dtype,
                         prefix_states: int = 0) -> StateSlots:
    """Zeroed states of `slots` sequences and `prefix_states` cached prefixes, bound to each linear-attention layer
    (conv_state in the model's dtype, recurrent_state in float32); the slots' free list, with the prefix cache."""
    layers = model.linear_attention_layers()
    for layer in layers:
        la = layer.la
        rows = slots + prefix_states
        layer.conv_state = torch.zeros(rows, la.conv_channels, la.conv_kernel - 1, dtype=dtype, device=device)
        layer.recurrent_state = torch.zeros(rows, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                                            dtype=torch.float32, device=device)
    prefix = (PrefixStates(range(slots, slots + prefix_states), functools.partial(_copy_row, layers))
              if prefix_states else None)
    return StateSlots(slots, functools.partial(_zero_slot, layers), bytes_per_slot(model, dtype), prefix)


def _zero_slot(layers, slot: int) -> None:
    for layer in layers:  # queued on the device's stream, ahead of the step that first reads the slot
        layer.conv_state[slot].zero_()
        layer.recurrent_state[slot].zero_()


def _copy_row(layers, src: int, dst: int) -> None:
    for layer in layers:
        layer.conv_state[dst].copy_(layer.conv_state[src])
        layer.recurrent_state[dst].copy_(layer.recurrent_state[src])


# of the memory left after the weights (CUDA) or of cpu_kv_cache_bytes (CPU): the most the states of max_num_seqs
# sequences and of the cached prefixes may take; more lowers both. The KV cache gets the rest (kv_cache.num_kv_blocks)
MAX_STATE_SHARE = 0.5


def rows_that_fit(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(max_num_seqs, prefix states) whose states fit MAX_STATE_SHARE of the memory left: as asked when they fit,
    else the prefix cache gets at most half of what fits and the sequences the rest (a warning names each one
    lowered). Prefix states asked for: CacheConfig.prefix_states, as many as max_num_seqs when unset, none without
    prefix caching."""
    cache, per_slot = config.cache, bytes_per_slot(model, dtype)
    seqs = config.scheduler.max_num_seqs
    prefix = 0 if not cache.enable_prefix_caching else seqs if cache.prefix_states is None else cache.prefix_states
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free)
        knob = "--gpu-memory-utilization"
    else:
        budget, knob = cache.cpu_kv_cache_bytes, "--cpu-kv-cache-bytes"
    fits = max(1, int(budget * MAX_STATE_SHARE) // per_slot)
    if seqs + prefix <= fits:
        return seqs, prefix
    fit_prefix = min(prefix, fits // 2)
    fit_seqs = min(seqs, max(1, fits - fit_prefix))
    for name, want, got in (("max_num_seqs", seqs, fit_seqs), ("prefix_states", prefix, fit_prefix)):
        if got < want:
            logger.warning("%s lowered to %d from %d: each linear-attention state takes %.1f MiB (%s raises it)",
                           name, got, want, per_slot / 2**20, knob)
    return fit_seqs, fit_prefix


def serving_config(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> EngineConfig:
    """`config` as a model with recurrent state is served: max_num_seqs and the prefix states within the states'
    share of memory (rows_that_fit: prefix caching off when no prefix state fits); n-gram speculation and the
    whole-step prefill CUDA graphs off (see the module's docstring), the ones that were on named in the log."""
    off = []
    cache, runner, spec = config.cache, config.runner, config.speculative
    seqs, prefix = rows_that_fit(config, model, device, dtype)
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=seqs)
    if cache.enable_prefix_caching and not prefix:
        off.append("prefix caching")
    cache = dataclasses.replace(cache, enable_prefix_caching=bool(prefix), prefix_states=prefix)
    if spec.ngram_draft_tokens:
        off.append("n-gram speculative decoding")
        spec = dataclasses.replace(spec, ngram_draft_tokens=0)
    if not runner.enforce_eager and device.type == "cuda":
        off.append("single-sequence prefill CUDA graphs (piecewise graphs serve those steps)")
    runner = dataclasses.replace(runner, prefill_graph_tokens=(0,))
    if off:
        logger.info("linear-attention layers keep a recurrent state per sequence: %s off for this model",
                    ", ".join(off))
    return dataclasses.replace(config, cache=cache, runner=runner, speculative=spec, scheduler=scheduler)
