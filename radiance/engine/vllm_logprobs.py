"""LLM.generate's logprobs in vLLM's shape: per token a {token id: Logprob} dict of the chosen token and its
alternatives, from the engine's TokenLogprob entries (which the server keeps reading)."""

from __future__ import annotations

from collections.abc import Callable

from radiance.engine.outputs import Logprob, TokenLogprob


class TokenTexts:
    """Each token's text decoded on its own, as vLLM's decoded_token (and the server's logprobs) name it; decoded
    once per generate call (a full-vocabulary request names every token at each position)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def learn(self, entries: list[TokenLogprob]) -> None:
        if self.tokenizer is None:  # a token-id-only checkpoint: decoded_token stays None
            return
        ids = list(dict.fromkeys(tid for e in entries for tid in (e.token_id, *(t for t, _ in e.top))
                                 if tid not in self.known))
        if ids:
            self.known.update(zip(ids, self.tokenizer.batch_decode([[tid] for tid in ids])))


def vllm_logprobs(entries: list[TokenLogprob | None] | None,
                   texts: TokenTexts | None) -> list[dict[int, Logprob] | None] | None:
    """The engine's entries (None: a prompt's first token, which nothing scores) as vLLM's {token id: Logprob}."""
    if entries is None:
        return None
    if texts is not None:
        texts.learn([e for e in entries if e is not None])
    text = texts.known.get if texts is not None else (lambda _: None)
    return [None if e is None else _logprob_dict(e, text) for e in entries]


def _logprob_dict(entry: TokenLogprob, text: Callable[[int], str | None]) -> dict[int, Logprob]:
    """The token first, then its alternatives most likely first with ranks 1, 2, ..., as the server's
    prompt_logprobs: a token among its own alternatives keeps its own rank (they differ only on a tie)."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (tid, logprob) in enumerate(entry.top, 1):
        if tid not in out:
            out[tid] = Logprob(logprob, rank, text(tid))
    return out
