"""Token sampling for a batch of rows, each with its own settings.

First a row's structured-output and allowed_token_ids masks, bans (min_tokens', bad words': BadWords), logit bias
and repetition / frequency / presence penalties change its logits (fp32).
Greedy rows take the argmax. The others are scaled by temperature, filtered by top-k, top-p and min-p,
and sampled by the exponential race (argmax of p / E, E ~ Exp(1)), which needs no cumulative sum and
lets a seeded row draw its noise from its own generator: the same seed gives the same tokens however
the batch around it is composed. Logprobs are those of the unmodified distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radiance.kernels.argmax import argmax_rows

# a temperature below this samples greedily: it is greedy in all but name, and far below it (1e-40) logits /
# temperature overflow float32 to inf and the softmax to NaN (vLLM's _SAMPLING_EPS)
GREEDY_BELOW = 1e-5
# penalized logits are held within +-LOGIT_LIMIT, which any temperature (>= GREEDY_BELOW) keeps finite in
# float32: a repetition penalty of 1e-30 took a seen token's logit to inf, and the softmax to NaN
LOGIT_LIMIT = 1e30
FLOAT32_MAX = torch.finfo(torch.float32).max


class OutputCounts:
    """A sequence's output token counts on the device, kept up to date a few tokens per step (rebuilding
    them from the host's lists cost ~19 ms per step for 64 sequences of 1000 tokens), and the set of its
    prompt tokens when a repetition penalty needs it: 5 bytes per vocabulary entry per penalized sequence."""

    def __init__(self, vocab: int, device: torch.device, prompt_ids: list[int] | None):
        self.counts = torch.zeros(vocab, device=device)
        self.counted = 0
        self.prompt_seen = None
        if prompt_ids is not None:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.prompt_seen[small_tensor_to(prompt_ids, device)] = True

    def catch_up(self, new_ids: list[int]) -> None:
        """Count output tokens the host got since the last call."""
        if new_ids:
            ids = small_tensor_to(new_ids, self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new_ids), device=self.counts.device))
            self.counted += len(new_ids)


class BadWords:
    """A request's bad words as token-id sequences (SamplingParams.bad_words_token_ids) and the tokens they ban
    next, as vLLM's: a one-token word always; a longer word its last token, where the output so far (not the
    prompt) ends with its other tokens. Only the longer words need the output, so only they make the engine
    sample a sequence once the host has its previous token."""

    def __init__(self, sequences):
        self.always = tuple(sorted({word[0] for word in sequences if len(word) == 1}))
        # the longer words by the last token of their prefix: a step looks up the newest output token only
        self.after: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for word in {tuple(word) for word in sequences if len(word) > 1}:
            self.after.setdefault(word[-2], []).append((word[:-1], word[-1]))
        # the most output tokens a ban reads (the longest prefix)
        self.context = max((len(prefix) for words in self.after.values() for prefix, _ in words), default=0)

    @property
    def needs_output(self) -> bool:
        """Whether a ban depends on the output so far (a word of more than one token)."""
        return bool(self.after)

    def banned(self, output) -> tuple[int, ...]:
        """The tokens banned after `output`: the output token ids so far, or their last `context` at least."""
        if not output or not self.after:
            return self.always
        hits = {last for prefix, last in self.after.get(output[-1], ())
                if len(prefix) <= len(output) and tuple(output[len(output) - len(prefix):]) == prefix}
        return tuple(sorted(hits.union(self.always))) if hits else self.always


@dataclass
class LogitAdjustment:
    """A row's logit bias and penalties; `output` holds the output tokens the host knows (one still on the
    device comes as adjust_logits' `pending`), and the prompt's for a repetition penalty. `allowed`: the
    tokens a structured output allows next, as int32 words on the logits' device (xgrammar's bitmask:
    token 32 i + j is allowed when bit j of word i is set). `banned`: tokens set to -inf, whatever the rest.
    `disallowed`: a bool [V] on the logits' device, True for the tokens SamplingParams.allowed_token_ids leaves out."""

    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    output: OutputCounts | None = None
    allowed: torch.Tensor | None = None
    # set to -inf: SamplingParams.min_tokens' (the tokens that would end the output), bad words' (BadWords)
    banned: tuple[int, ...] = ()
    disallowed: torch.Tensor | None = None


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
    # per row: None or (logprob of the sampled token, [(token id, logprob), ...] top alternatives, its rank)
    logprobs: list[tuple[float, list[tuple[int, float]], int] | None]


def small_tensor_to(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the GPU: a plain torch.tensor(...,
    device=cuda) copies from pageable memory and synchronizes the stream, which would stall the next
    decode step that the engine queues behind this one."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def apply_token_masks(logits: torch.Tensor, adj: list[LogitAdjustment]) -> None:
    """Sets to -inf, in place, the tokens each row's structured output does not allow (fp32 logits [R, V],
    row r for adj[r]; rows without a mask unchanged), with xgrammar's kernel (Triton on CUDA, C++ on CPU)."""
    import xgrammar  # loaded only once a structured request has come

    words = [a.allowed for a in adj if a.allowed is not None]
    if len(words) < len(adj):  # a row of all-ones words masks nothing
        free = torch.full_like(words[0], -1)
        words = [a.allowed if a.allowed is not None else free for a in adj]
    xgrammar.apply_token_bitmask_inplace(logits, torch.stack(words), vocab_size=logits.shape[-1])


def adjust_logits(logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] with each row's structured-output and allowed_token_ids masks (-inf where a token is not
    allowed), bans, bias, then repetition, frequency and presence penalties applied (vLLM's order and formulas),
    fp32; unchanged (same tensor) when no row asks. `pending` [B]: each row's newest output token where it is
    still on the device (an overlapped decode step), counted as output."""
    picked = [i for i, r in enumerate(rows) if r.adjust is not None]
    if not picked:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    adj = [rows[i].adjust for i in picked]
    # a ban is a bias of -inf: it rides the bias's one indexed add (and stays -inf through the penalties)
    bias = [(j, t, b) for j, a in enumerate(adj) for t, b in a.bias] + \
        [(j, t, float("-inf")) for j, a in enumerate(adj) for t in a.banned]
    penalized = [j for j, a in enumerate(adj) if a.output is not None]
    limited = any(a.disallowed is not None for a in adj)
    if not bias and not penalized and not limited and all(a.allowed is None for a in adj):
        return logits  # nothing to apply this step (bad words of several tokens whose prefixes are not written)
    if len(picked) == len(rows) and not bias and not penalized and not limited:  # structured output only
        out = _fp32_copy(logits)
        apply_token_masks(out, adj)
        return out
    # what the host knows goes over in one transfer per dtype (each pinned copy costs tens of us); device
    # index tensors throughout, as a host list used as an index is copied synchronously
    ints = small_tensor_to(picked + [j for j, _, _ in bias] + [t for _, t, _ in bias] + penalized, device)
    idx, rows_b, toks_b, pen = ints.split((len(picked), len(bias), len(bias), len(penalized)))
    floats = small_tensor_to([b for _, _, b in bias] + [adj[j].repetition for j in penalized]
                             + [adj[j].frequency for j in penalized] + [adj[j].presence for j in penalized], device)
    vals_b, rep, freq, pres = (part.float().unsqueeze(1) for part in floats.split(
        (len(bias), len(penalized), len(penalized), len(penalized))))
    sub = logits[idx].float()
    if any(a.allowed is not None for a in adj):
        apply_token_masks(sub, adj)
    if limited:  # allowed_token_ids: one masked_fill over the rows (a row without a list masks nothing)
        free = torch.zeros(vocab, dtype=torch.bool, device=device)
        sub.masked_fill_(torch.stack([a.disallowed if a.disallowed is not None else free for a in adj]),
                         float("-inf"))
    if bias:
        # a structured output (or allowed_token_ids) that allows only tokens min_tokens bans (its end) keeps its
        # own mask: with every logit -inf the choice was token 0, text the constraint then refused
        masked = sub.clone() if any((a.allowed is not None or a.disallowed is not None) and a.banned
                                    for a in adj) else None
        sub.index_put_((rows_b, toks_b), vals_b.squeeze(1), accumulate=True)
        if masked is not None:
            sub = torch.where(torch.isneginf(sub).all(-1, keepdim=True), masked, sub)
    if penalized:
        counts = torch.stack([adj[j].output.counts for j in penalized])
        if pending is not None:
            counts.scatter_add_(1, pending[idx[pen]].long().unsqueeze(1), torch.ones(len(penalized), 1, device=device))
        part = sub[pen]
        if any(adj[j].repetition != 1.0 for j in penalized):
            none = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen = torch.stack([adj[j].output.prompt_seen if adj[j].output.prompt_seen is not None else none
                                for j in penalized]) | (counts > 0)
            part = torch.where(seen & part.isfinite(), _repetition_penalized(part, rep), part)  # masks stay -inf
        sub[pen] = part - freq * counts - pres * (counts > 0)
    out = _fp32_copy(logits)
    out[idx] = sub
    return out


def _repetition_penalized(logits: torch.Tensor, rep: torch.Tensor) -> torch.Tensor:
    """logits / rep where positive, else * rep (vLLM's formula), held finite: rep 1e-308 is 0 in float32
    (x / 0 = inf) and 1e308 is inf (0 * inf = NaN)."""
    rep = rep.clamp(torch.finfo(torch.float32).tiny, FLOAT32_MAX)
    return torch.where(logits > 0, logits / rep, logits * rep).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)


def _fp32_copy(logits: torch.Tensor) -> torch.Tensor:
    out = logits.float()
    return out.clone() if out.data_ptr() == logits.data_ptr() else out  # the caller keeps the model's logits


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p / min-p exclude; logits already temperature-scaled."""
    device = logits.device
    vocab = logits.shape[-1]
    # clamped to the vocabulary: a top_k past int64 (2**70 from a client) overflowed the tensor in the engine loop
    top_k = small_tensor_to([min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows], device)
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
    random_rows = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_BELOW]
    if random_rows:
        idx = small_tensor_to(random_rows, logits.device)
        sub_rows = [rows[i] for i in random_rows]
        # float32 turns a temperature past its range (1e308) into inf, and a masked logit / inf is NaN
        temps = small_tensor_to([min(r.temperature, FLOAT32_MAX) for r in sub_rows], logits.device).unsqueeze(1)
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


def ranked_token_logprobs(logits: torch.Tensor, ids: list[int],
                          k: int) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Per row of logits [R, V]: (log-probability of ids[row], its k most likely (token, logprob), its rank: 1 + the
    tokens more likely than it, vLLM's, counted on the same fp32 log-softmax), read back together."""
    lp = logits.float().log_softmax(-1)
    picked = torch.tensor(ids, device=lp.device)[:, None]
    chosen = lp.gather(1, picked)
    ranks = (lp > chosen).sum(-1) + 1
    if k == 0:
        return [(c, [], r) for c, r in zip(chosen[:, 0].tolist(), ranks.tolist())]
    top_vals, top_ids = lp.topk(k, dim=-1)
    return list(zip(chosen[:, 0].tolist(), [list(zip(t, v)) for t, v in zip(top_ids.tolist(), top_vals.tolist())],
                    ranks.tolist()))


def read_samples(logits: torch.Tensor, ids: list[int], rows: list[SamplingRow]) -> SamplerOutput:
    """The sampler output for ids already read back, with the logprobs asked for: per such row (logprob of the
    token, its alternatives, its rank), the rank from the same logits (vLLM gives every sampled token one)."""
    logprobs: list = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if wanted:
        k = max(rows[i].num_logprobs for i in wanted)
        chosen_ids = [ids[i] for i in wanted]
        for i, (chosen, top, rank) in zip(wanted, ranked_token_logprobs(logits[wanted], chosen_ids, k)):
            logprobs[i] = (chosen, top[:rows[i].num_logprobs], rank)
    return SamplerOutput(ids, logprobs)
