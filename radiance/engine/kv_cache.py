"""Sizing and allocating the paged KV cache (from free GPU memory on CUDA, from a byte budget on the CPU), and the
max_model_len checks against the model's context and the cache's capacity."""

from __future__ import annotations

import logging

import torch

from radiance.config import CacheConfig, SchedulerConfig
from radiance.engine.kv_layout import KvLayout
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def kv_cache_dtype(device: torch.device, model_dtype: torch.dtype, wanted: str = "auto") -> torch.dtype:
    """The KV cache's dtype. `fp8`: e4m3, values stored rounded to nearest and saturated at +-448, read
    back widened (every path: Triton kernels and the torch reference). `auto`: the model's on CUDA; float32
    on the CPU, where the decode attention runs SDPA in float32 (it is several times faster there than in
    16 bits) and can then read the cache in place instead of converting the whole context every step. The
    values stored are the model's, widened exactly; the price is twice the bytes per token of
    `cpu_kv_cache_bytes` for a 16-bit model."""
    if wanted == "fp8":
        return torch.float8_e4m3fn
    return model_dtype if device.type == "cuda" else torch.float32


def block_bytes(arch, block_size: int, dtype: torch.dtype, layout: KvLayout | None = None) -> int:
    """Bytes of one KV block (a page: `layout.slots` layers, all of them without a layout) of a model whose
    ArchConfig is `arch`."""
    slots = len(arch.attention_layer_ids) if layout is None else layout.slots
    per_token = 2 * slots * arch.num_kv_heads * arch.head_dim * torch.tensor([], dtype=dtype).element_size()
    return per_token * block_size


@torch.inference_mode()
def _peak_activation_bytes(model, device: torch.device, num_tokens: int, max_sampled_rows: int) -> int:
    """Run one cache-less forward over a full token budget and report the allocator's peak above idle."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), None)
    model.compute_logits(hidden[-min(num_tokens, max_sampled_rows):])  # the sampled rows of a full decode batch
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden
    torch.cuda.empty_cache()
    return peak


def blocks_known_before_load(arch, cache: CacheConfig, device: torch.device, dtype: torch.dtype,
                             layout: KvLayout | None = None, states_bytes: int = 0) -> int | None:
    """The KV block count where no weights are needed to know it (an override, or the CPU's byte budget, less the
    `states_bytes` a hybrid model's linear-attention states take of it), so that a max_model_len it cannot hold is
    refused before the load; None on CUDA, where it comes from the memory left after the weights (and the states)
    and an activation probe."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type == "cuda":
        return None
    return _blocks_of(cache.cpu_kv_cache_bytes - states_bytes, block_bytes(arch, cache.block_size, dtype, layout),
                      f"raise --cpu-kv-cache-bytes (now {cache.cpu_kv_cache_bytes}); in Python: cpu_kv_cache_bytes")


def num_kv_blocks(model, cache: CacheConfig, scheduler: SchedulerConfig, device: torch.device,
                  dtype: torch.dtype, layout: KvLayout | None = None, states_bytes: int = 0) -> int:
    known = blocks_known_before_load(model.config, cache, device, dtype, layout, states_bytes)
    if known is not None:
        return known
    per_block = block_bytes(model.config, cache.block_size, dtype, layout)
    peak = _peak_activation_bytes(model, device, scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, other processes, the allocator's reserve
    budget = int(total * cache.gpu_memory_utilization) - used - peak
    logger.info("KV budget: %.2f GiB (total %.1f, in use %.1f, activation peak %.2f GiB, utilization %.2f)",
                budget / 2**30, total / 2**30, used / 2**30, peak / 2**30, cache.gpu_memory_utilization)
    return _blocks_of(budget, per_block,
                      f"raise --gpu-memory-utilization (now {cache.gpu_memory_utilization}) or lower "
                      f"--max-num-batched-tokens (now {scheduler.max_num_batched_tokens}); in Python: "
                      "gpu_memory_utilization, max_num_batched_tokens")


def _blocks_of(budget: int, per_block: int, knobs: str) -> int:
    """The blocks `budget` bytes hold; none is an error saying what raises it on this device (`knobs`), in the
    flags' words and the fields' (the CLI's user typed flags, the LLM API's gives fields)."""
    blocks = budget // per_block
    if blocks < 1:
        raise ConfigError(f"no memory left for the KV cache ({budget / 2**20:.0f} MiB available, "
                          f"{per_block / 2**20:.2f} MiB per block): {knobs}")
    return int(blocks)


def allocate_kv_cache(model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                      layout: KvLayout | None = None) -> torch.Tensor:
    """One tensor [2, layout.slots, blocks, block_size, kv_heads, head_dim] (zeros); each attention layer gets the
    views of its slot and learns its group (Attention.kv_group). A layout that releases pages has one block more:
    the null page (block `num_blocks`) its released table entries point at."""
    cfg = model.config
    layout = layout or KvLayout.single(len(cfg.attention_layer_ids))
    pages = num_blocks + (1 if layout.releases_pages else 0)
    cache = torch.zeros(2, layout.slots, pages, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    for i, attn in enumerate(model.attention_layers()):
        group, slot = layout.place(i)
        attn.k_cache = cache[0, slot]
        attn.v_cache = cache[1, slot]
        attn.kv_group = group
    return cache


def check_max_model_len(requested: int | None, context: int, source: str = "max_position_embeddings") -> None:
    """Refuses a max_model_len above the model's context, as vLLM does (it was lowered with a warning that
    scrolled away). vLLM's override (VLLM_ALLOW_LONG_MAX_MODEL_LEN) has no counterpart: the rotary table ends at
    the context, and a position past it is an IndexError on the CPU, an out-of-bounds read on CUDA."""
    if requested is not None and requested > context:
        raise ConfigError(f"max_model_len {requested} exceeds the model's context of {context} tokens ({source}): "
                          f"use --max-model-len {context} or less")


def kv_capacity(num_blocks: int, block_size: int, layout: KvLayout | None = None, step_tokens: int = 0,
                limit: int | None = None) -> int:
    """Tokens one sequence may hold in `num_blocks` blocks: all of them x block_size, or with a layout whose local
    groups release pages (computed in steps of up to `step_tokens`), the longest length up to `limit` that fits."""
    if layout is None or not layout.releases_pages or limit is None:
        return num_blocks * block_size
    return layout.capacity(num_blocks, block_size, step_tokens, limit)


def check_kv_capacity(requested: int | None, num_blocks: int, block_size: int, cache, device_type: str,
                      capacity: int | None = None) -> None:
    """Refuses an explicit max_model_len above what the KV cache holds (`capacity` tokens, num_blocks x block_size
    unless given: see kv_capacity), as vLLM does ("The model's max seq len (X) is larger than the maximum number
    of tokens that can be stored in KV cache (Y)"): one line naming both numbers and the settings that raise the
    capacity on this device. None (not set: the model's context) is not checked here; the runner lowers it to
    the capacity with a warning."""
    capacity = num_blocks * block_size if capacity is None else capacity
    if requested is None or requested <= capacity:
        return
    if cache.num_gpu_blocks_override is not None:
        knobs = f"raise --num-gpu-blocks-override (now {cache.num_gpu_blocks_override})"
    elif device_type == "cuda":
        knobs = f"raise --gpu-memory-utilization (now {cache.gpu_memory_utilization})"
    else:
        knobs = f"raise --cpu-kv-cache-bytes (now {cache.cpu_kv_cache_bytes})"
    if cache.num_gpu_blocks_override is None and cache.kv_cache_dtype != "fp8":
        knobs += " or use --kv-cache-dtype fp8"
    raise ConfigError(f"max_model_len {requested} is larger than the KV cache holds: {capacity} tokens "
                      f"({num_blocks} blocks of {block_size}): {knobs}, or use --max-model-len {capacity} or less")
