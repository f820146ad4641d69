"""The recurrent state of a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet): per layer, a conv tail
[slots, channels, kernel - 1] and a float32 state [slots, value heads, key_head_dim, value_head_dim], one slot per
running sequence (vLLM's mamba cache). A sequence takes a slot with its first KV blocks and gives it back with them
(finished, aborted or preempted: a preempted sequence recomputes from its tokens, so from a fresh state).

A state holds the whole prefix in a fixed size (2 MiB a layer for Qwen3.5-9B) and cannot be rewound or shared: the
engine serves such models without prefix caching or speculative decoding, and a decode step queued ahead
(overlap.DecodeAhead) is never discarded — one that ran would have advanced the states — so while one is queued the
scheduler admits nobody (`DecodeAhead.pinned`; a request waits one decode step longer). The decode graphs
carry each sequence's slot (step_graphs.DecodeGraphs; a padding row's slot -1 touches no state); the prefill and
piecewise graphs, whose steps would need each sequence's "starts here" flag, are off (`serving_config`)."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from radiance.config import EngineConfig

logger = logging.getLogger(__name__)


def has_recurrent_state(model) -> bool:
    return bool(getattr(model, "linear_attention_layers", lambda: [])())


class StateSlots:
    """The free slots of the state cache; slot numbers index each layer's state tensors. A slot is zeroed as it is
    handed out (`reset`): the CUDA decode kernels continue whatever state a slot holds, and a sequence may start in a
    one-token step (a one-token prompt, or a chunk of one beside decodes)."""

    def __init__(self, count: int, reset=lambda slot: None, slot_bytes: int = 0):
        self.count = count
        self.reset = reset
        self.slot_bytes = slot_bytes  # one sequence's states over every layer (bytes_per_slot)
        self._free = list(range(count - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:  # the scheduler runs at most max_num_seqs sequences, one slot each
            raise RuntimeError(f"all {self.count} linear-attention state slots are taken")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


def bytes_per_slot(model, dtype: torch.dtype) -> int:
    """Bytes one sequence's states take over every linear-attention layer."""
    total = 0
    for layer in model.linear_attention_layers():
        la = layer.la
        conv = la.conv_channels * (la.conv_kernel - 1) * torch.tensor([], dtype=dtype).element_size()
        total += conv + la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
    return total


def allocate_state_cache(model, slots: int, device: torch.device, dtype: torch.dtype) -> StateSlots:
    """Zeroed states of `slots` sequences, bound to each linear-attention layer (conv_state in the model's dtype,
    recurrent_state in float32); their free list."""
    for layer in model.linear_attention_layers():
        la = layer.la
        layer.conv_state = torch.zeros(slots, la.conv_channels, la.conv_kernel - 1, dtype=dtype, device=device)
        layer.recurrent_state = torch.zeros(slots, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                                            dtype=torch.float32, device=device)
    return StateSlots(slots, functools.partial(_zero_slot, model.linear_attention_layers()),
                      bytes_per_slot(model, dtype))


def _zero_slot(layers, slot: int) -> None:
    for layer in layers:  # queued on the device's stream, ahead of the step that first reads the slot
        layer.conv_state[slot].zero_()
        layer.recurrent_state[slot].zero_()


# of the memory left after the weights (CUDA) or of cpu_kv_cache_bytes (CPU): the most the states of max_num_seqs
# sequences may take; more lowers max_num_seqs. The KV cache gets the rest (kv_cache.num_kv_blocks)
MAX_STATE_SHARE = 0.5


def slots_that_fit(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> int:
    """max_num_seqs, lowered (with a warning) to the sequences whose states fit MAX_STATE_SHARE of the memory left."""
    wanted, per_slot = config.scheduler.max_num_seqs, bytes_per_slot(model, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.cache.gpu_memory_utilization) - (total - free)
        knob = "--gpu-memory-utilization"
    else:
        budget, knob = config.cache.cpu_kv_cache_bytes, "--cpu-kv-cache-bytes"
    fits = max(1, int(budget * MAX_STATE_SHARE) // per_slot)
    if fits < wanted:
        logger.warning("max_num_seqs lowered to %d from %d: each sequence's linear-attention state takes %.1f MiB "
                       "(%s raises it)", fits, wanted, per_slot / 2**20, knob)
        return fits
    return wanted


def serving_config(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> EngineConfig:
    """`config` as a model with recurrent state is served: max_num_seqs within the states' share of memory
    (slots_that_fit); prefix caching, n-gram speculation and the prefill / piecewise CUDA graphs off (see the
    module's docstring), the ones that were on named in the log."""
    off = []
    cache, runner, spec = config.cache, config.runner, config.speculative
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=slots_that_fit(config, model, device, dtype))
    if cache.enable_prefix_caching:
        off.append("prefix caching")
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if spec.ngram_draft_tokens:
        off.append("n-gram speculative decoding")
        spec = dataclasses.replace(spec, ngram_draft_tokens=0)
    if not runner.enforce_eager and device.type == "cuda":
        off.append("prefill and piecewise CUDA graphs")
    runner = dataclasses.replace(runner, prefill_graph_tokens=(0,), piecewise_graph_tokens=(0,))
    if off:
        logger.info("linear-attention layers keep a recurrent state per sequence: %s off for this model",
                    ", ".join(off))
    return dataclasses.replace(config, cache=cache, runner=runner, speculative=spec, scheduler=scheduler)
