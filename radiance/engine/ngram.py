"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a sequence's last n
tokens (longest n first), which a speculative step then checks in one forward."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram_drafts(token_ids: list[int], max_drafts: int, n_max: int, n_min: int) -> list[int]:
    """Up to `max_drafts` tokens continuing `token_ids`, or [] when no suffix of n_min..n_max tokens occurs
    earlier."""
    if max_drafts <= 0 or len(token_ids) <= n_min:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        # windows starting before the suffix itself; the latest match tends to continue best
        windows = sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + max_drafts].tolist()
    return []


def may_find_drafts(token_ids: list[int], n_min: int) -> bool:
    """Whether the lookup after one more (unknown) token can match: its suffix holds the last n_min - 1
    known tokens, so they must occur earlier. Lets a step that cannot speculate next keep the overlap."""
    n = n_min - 1
    if n == 0:
        return len(token_ids) > 0
    if len(token_ids) <= n:
        return False
    ids = np.asarray(token_ids, dtype=np.int64)
    return bool((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1).any())
