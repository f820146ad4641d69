"""Token sampling for a batch of rows, each with its own settings.

First a row's logit bias and repetition / frequency / presence penalties change its logits (fp32).
Greedy rows take the argmax. The others are scaled by temperature, filtered by top-k, top-p and min-p,
and sampled by the exponential race (argmax of p / E, E ~ Exp(1)), which needs no cumulative sum and
lets a seeded row draw its noise from its own generator: the same seed gives the same tokens however
the batch around it is composed. Logprobs are those of the unmodified distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radiance.kernels.argmax import argmax_rows


@dataclass
class LogitAdjustment:
    """A row's logit bias and penalties, with the tokens they look at that the host knows: the prompt
    (repetition penalty only) and the output so far (a token still on the device comes as `pending`)."""

    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


@dataclass
class SamplingRow:
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    generator: torch.Generator | None = None
    num_logprobs: int | None = None
    adjust: LogitAdjustment | None = None


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


def _padded_ids(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 [len(lists), longest] with `pad` after each list's end."""
    width = max(1, max(len(ids) for ids in lists))
    return small_tensor_to([ids + [pad] * (width - len(ids)) for ids in lists], device)


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] with each row's bias, then repetition, frequency and presence penalties applied (vLLM's
    order and formulas), fp32; unchanged (same tensor) when no row asks. `pending` [B]: each row's newest
    output token where it is still on the device (an overlapped decode step), counted as output."""
    picked = [i for i, r in enumerate(rows) if r.adjust is not None]
    if not picked:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    adj = [rows[i].adjust for i in picked]
    idx = small_tensor_to(picked, device)
    sub = logits[idx].float()
    bias = [(j, t, b) for j, a in enumerate(adj) for t, b in a.bias]
    if bias:
        rows_b, toks_b, vals_b = (small_tensor_to(list(col), device) for col in zip(*bias))
        sub.index_put_((rows_b, toks_b), vals_b.float(), accumulate=True)
    # output token counts; padding goes to an extra column that is dropped
    counts = torch.zeros(len(picked), vocab + 1, device=device)
    outputs = _padded_ids([a.output_ids for a in adj], vocab, device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=counts.dtype))
    if pending is not None:
        counts.scatter_add_(1, pending[idx].long().unsqueeze(1), torch.ones(len(picked), 1, device=device))
    counts = counts[:, :vocab]
    if any(a.repetition != 1.0 for a in adj):
        seen = torch.zeros(len(picked), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, _padded_ids([a.prompt_ids for a in adj], vocab, device), True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = small_tensor_to([a.repetition for a in adj], device).float().unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = small_tensor_to([a.frequency for a in adj], device).float().unsqueeze(1)
    pres = small_tensor_to([a.presence for a in adj], device).float().unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0)
    out = logits.float()
    if out.data_ptr() == logits.data_ptr():
        out = out.clone()  # the caller keeps the model's logits for logprobs
    out[idx] = sub
    return out


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


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None) -> torch.Tensor:
    """The sampled token ids [B] (int64), left on logits' device: nothing waits for the GPU here.
    logits may be in the model's dtype: only the rows that sample at random are converted to fp32 (all
    rows when one has a bias or penalties). `pending`: see adjust_logits."""
    logits = adjust_logits(logits, rows, pending)
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
