"""How a model's attention layers share the paged KV cache: groups of layers, each with its own block table.

A model whose layers all attend to the whole context has one group: a cache page holds every layer's K/V of
`block_size` tokens, and a sequence has one block table. A model with local layers (a sliding window: Gemma 2 / 3,
gpt-oss, Mistral; chunked attention: Llama 4) keeps the K/V those layers no longer read only until the window
moves past it: their layers form groups of their own (vLLM's hybrid KV cache manager). Every group has the same
number of layer slots per page, so the groups draw pages from one pool; a local group's pages behind its
window go back to the pool as the sequence grows, and its block table points them at a null page (zeros,
never written, never read: every attention path starts reading at the window).

With F full-attention layers, the slots per page are F, and each kind of local layer (one window or chunk)
fills ceil(n / F) groups; the last may leave slots unused. A layout that would leave more than a quarter of the
model's layers in unused slots (e.g. 2 local layers beside 30 full ones) keeps one group, as does
`CacheConfig.hybrid_kv_cache=False` (vLLM's --disable-hybrid-kv-cache-manager).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_UNUSED_SLOTS = 0.25  # of the model's layers: past it one group costs fewer bytes at short contexts


@dataclass(frozen=True)
class LocalSpan:
    """What a local layer reads: a sliding window of `window` tokens (itself included), or the keys of its own
    chunk of `chunk` tokens."""

    window: int | None = None
    chunk: int | None = None

    def first_read(self, position: int) -> int:
        """The first position the query at `position` reads."""
        if self.chunk is not None:
            return position // self.chunk * self.chunk
        return max(0, position - self.window + 1)

    @property
    def tokens(self) -> int:
        """Positions a query reads at most, itself included."""
        return self.chunk if self.chunk is not None else self.window


@dataclass(frozen=True)
class KvLayout:
    """`groups[g]`: the layers (attention layer indices) of group g in slot order; `spans[g]`: its LocalSpan, None
    for full attention. `slots`: layer slots per page (the most layers a group has)."""

    slots: int
    groups: tuple[tuple[int, ...], ...]
    spans: tuple[LocalSpan | None, ...]

    @classmethod
    def single(cls, num_layers: int) -> KvLayout:
        return cls(num_layers, (tuple(range(num_layers)),), (None,))

    @classmethod
    def of(cls, arch, hybrid: bool = True) -> KvLayout:
        """The layout of a model whose ArchConfig is `arch` (window_of / chunk_of name each layer's span) over its
        attention layers (a hybrid model's linear-attention layers keep no KV: engine.state_cache)."""
        ids = arch.attention_layer_ids
        layers = range(len(ids))  # attention layer indices (model.attention_layers())
        span_of = [_span(arch.window_of(i), arch.chunk_of(i)) for i in ids]
        if not hybrid or all(s is None for s in span_of):
            return cls.single(len(ids))
        kinds: dict[LocalSpan | None, list[int]] = {}
        for i in layers:
            kinds.setdefault(span_of[i], []).append(i)
        if len(kinds) == 1:  # every layer local, one kind (Mistral): one group whose pages are released
            return cls(len(ids), (tuple(layers),), (span_of[0],))
        slots = len(kinds[None]) if None in kinds else min(len(v) for v in kinds.values())
        groups, spans = [], []
        for span, members in sorted(kinds.items(), key=lambda kv: kv[0] is not None):  # full attention first
            for start in range(0, len(members), slots):
                groups.append(tuple(members[start:start + slots]))
                spans.append(span)
        if len(groups) * slots - len(ids) > MAX_UNUSED_SLOTS * len(ids):
            return cls.single(len(ids))
        return cls(slots, tuple(groups), tuple(spans))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def releases_pages(self) -> bool:
        """Whether some group gives pages back behind its window (the cache then has a null page)."""
        return any(s is not None for s in self.spans)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of attention layer `layer`."""
        for g, members in enumerate(self.groups):
            if layer in members:
                return g, members.index(layer)
        raise ValueError(f"layer {layer} is in no KV group of {self.groups}")

    def first_kept_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of `group` that a step whose first new token sits at `position` reads (0: all)."""
        span = self.spans[group]
        return 0 if span is None else span.first_read(position) // block_size

    def pages_for(self, tokens: int, block_size: int, step_tokens: int) -> int:
        """Pages one sequence of `tokens` tokens holds at most, computed in steps of up to `step_tokens`."""
        blocks = -(-tokens // block_size)
        total = 0
        for span in self.spans:
            if span is None:
                total += blocks
            else:  # its span behind a step's first token and the step's tokens, over block boundaries
                total += min(blocks, -(-(span.tokens + step_tokens) // block_size) + 1)
        return total

    def capacity(self, num_pages: int, block_size: int, step_tokens: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose pages fit in `num_pages` on its own."""
        if self.pages_for(limit, block_size, step_tokens) <= num_pages:
            return limit
        low, high = 0, limit  # pages_for grows with tokens: the last length that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self.pages_for(mid, block_size, step_tokens) <= num_pages:
                low = mid
            else:
                high = mid - 1
        return low

    def describe(self) -> str:
        if self.num_groups == 1 and not self.releases_pages:
            return f"one KV group of {self.slots} layers"
        counts: dict[str, int] = {}
        for span in self.spans:
            kind = ("full attention" if span is None else f"window {span.window}" if span.chunk is None
                    else f"chunk {span.chunk}")
            counts[kind] = counts.get(kind, 0) + 1
        kinds = ", ".join(f"{n} x {kind}" for kind, n in counts.items())
        return (f"KV groups of {self.slots} layers: {kinds} (local layers release the blocks behind their span; "
                f"{self.num_groups * self.slots - sum(map(len, self.groups))} slots unused)")


def _span(window: int | None, chunk: int | None) -> LocalSpan | None:
    return None if window is None and chunk is None else LocalSpan(window, chunk)
