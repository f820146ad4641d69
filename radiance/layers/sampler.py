"""Token sampling for a batch of rows, each with its own settings.

Greedy rows take the argmax. The others are scaled by temperature, filtered by top-k, top-p and min-p,
and sampled by the exponential race (argmax of p / E, E ~ Exp(1)), which needs no cumulative sum and
lets a seeded row draw its noise from its own generator: the same seed gives the same tokens however
the batch around it is composed. Logprobs are those of the unmodified distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radiance.kernels.argmax import argmax_rows


@dataclass
class SamplingRow:
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None or (logprob of the sampled token, [(token id, logprob), ...] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def small_tensor_to(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the GPU: a plain torch.tensor(...,
    device=cuda) copies from pageable memory and synchronizes the stream, which would stall the next
    decode step that the engine queues behind this one."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude; logits already temperature-scaled."""
    device = logits.device
    vocab = logits.shape[-1]
    top_k = small_tensor_to([r.top_k if r.top_k > 0 else vocab for r in rows], device)
    top_p = small_tensor_to([r.top_p for r in rows], device)
    min_p = small_tensor_to([r.min_p for r in rows], device)
    if any(r.min_p > 0 for r in rows):
        probs = logits.softmax(-1)
        keep = probs >= min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    if any(0 < r.top_k < vocab for r in rows) or any(r.top_p < 1.0 for r in rows):
        sorted_logits, order = logits.sort(-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the first always stays
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits [B, V] float32 -> one token per row (and logprobs where asked)."""
    logits = logits.float()
    return read_samples(logits, sample_on_device(logits, rows).tolist(), rows)


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampled token ids [B] (int64), left on logits' device: nothing waits for the GPU here.
    logits may be in the model's dtype: only the rows that sample at random are converted to fp32."""
    greedy_ids = argmax_rows(logits)
    token_ids = greedy_ids
    random_rows = [i for i, r in enumerate(rows) if r.temperature > 0]
    if random_rows:
        idx = small_tensor_to(random_rows, logits.device)
        sub_rows = [rows[i] for i in random_rows]
        temps = small_tensor_to([r.temperature for r in sub_rows], logits.device).unsqueeze(1)
        probs = _filter(logits[idx].float() / temps, sub_rows).softmax(-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(sub_rows) if r.generator is None]
        if len(unseeded) == len(sub_rows):
            noise.exponential_()
        elif unseeded:
            fresh = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
            noise[small_tensor_to(unseeded, probs.device)] = fresh
        for j, r in enumerate(sub_rows):
            if r.generator is not None:
                noise[j].exponential_(generator=r.generator)
        token_ids = greedy_ids.clone()
        token_ids[idx] = (probs / noise).argmax(-1)
    return token_ids


def read_samples(logits: torch.Tensor, ids: list[int], rows: list[SamplingRow]) -> SamplerOutput:
    """The sampler output for ids already read back, with the logprobs asked for."""
    logprobs: list = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if wanted:
        lp = logits[wanted].float().log_softmax(-1)
        k = max(rows[i].num_logprobs for i in wanted)
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1) if k > 0 else (None, None)
        chosen = lp.gather(1, torch.tensor([[ids[i]] for i in wanted], device=lp.device)).squeeze(1).tolist()
        for j, i in enumerate(wanted):
            n = rows[i].num_logprobs
            top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else []
            logprobs[i] = (chosen[j], top)
    return SamplerOutput(ids, logprobs)
