"""Token logprobs as the APIs write them: chat's `logprobs.content`, completions' parallel lists with text offsets,
vLLM's `prompt_logprobs`; and which of a streamed choice's logprobs may go out yet (a token's once its text has)."""

from __future__ import annotations

import math
from typing import Any, Callable

from radiance.server.token_bytes import token_bytes

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def prompt_logprobs_json(tokenizer: Any, entries: list | None, as_ids: bool = False) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first, which nothing scores) {token id: {logprob,
    rank, decoded_token}} for the token itself and its alternatives, most likely first."""
    if entries is None:
        return None
    scored = [e for e in entries if e is not None]
    name = token_name(token_texts(tokenizer, scored), as_ids)
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(entry.token_id): {"logprob": safe_logprob(entry.logprob), "rank": entry.rank,
                                        "decoded_token": name(entry.token_id)}}
        for rank, (tid, lp) in enumerate(entry.top, 1):
            ranked.setdefault(str(tid), {"logprob": safe_logprob(lp), "rank": rank, "decoded_token": name(tid)})
        out.append(ranked)
    return out


def logprob_token_ids(entries: list) -> list[int]:
    """Every token id in these logprob entries (chosen and alternatives), once each."""
    return list(dict.fromkeys([e.token_id for e in entries] + [tid for e in entries for tid, _ in e.top]))


def token_texts(tokenizer: Any, entries: list) -> dict[int, str]:
    """Text of every token id in these logprob entries (chosen and alternatives), decoded in one batch."""
    ids = logprob_token_ids(entries)
    return dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def token_chars(token: str) -> int:
    """Characters a token's own text adds to the output. A token holding part of a multi-byte character
    decodes alone to U+FFFD, and counts 0: its character is counted nowhere, so a count never runs ahead of
    the output (it may lag it by those characters)."""
    return len(token) - token.count("\ufffd")


class LogprobCursor:
    """Which of a choice's token logprobs went out: a token's goes out once its text has (tokens_sent), the rest
    when the choice finishes (tokens_started). Chat and completions release them alike."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # tokens the detokenizer leaves out of the text (EOS let through by ignore_eos, ...): they add no characters
        self.textless = textless_tokens(tokenizer, skip_special_tokens)
        self.sent = 0  # logprob entries sent
        self.chars = 0  # characters of their tokens: the text offset of the next

    def release(self, out: Any, sent_chars: int) -> tuple[list, dict, int] | None:
        """(entries, their token texts, the text offset of the first) of `out`'s logprobs whose text is among the
        `sent_chars` characters sent so far; None when no new one is."""
        if out.logprobs is None or len(out.logprobs) <= self.sent:
            return None
        waiting = out.logprobs[self.sent:]
        texts = token_texts(self.tokenizer, waiting)
        tokens = ["" if e.token_id in self.textless else texts[e.token_id] for e in waiting]
        if out.finished and out.finish_reason == "length":  # nothing was cut from the text: every token's
            ready = len(waiting)
        else:
            ready = (tokens_started if out.finished else tokens_sent)(tokens, self.chars, sent_chars)
        if not ready:
            return None
        offset = self.chars
        self.sent += ready
        self.chars += sum(token_chars(token) for token in tokens[:ready])
        return waiting[:ready], texts, offset


def textless_tokens(tokenizer: Any, skip_special_tokens: bool) -> frozenset[int]:
    """The ids whose text the output leaves out: the special tokens, when the request skips them."""
    return frozenset(getattr(tokenizer, "all_special_ids", None) or ()) if skip_special_tokens else frozenset()


def tokens_sent(tokens: list[str], before: int, sent: int) -> int:
    """How many of `tokens` (the texts of tokens whose logprobs wait, starting `before` characters into the
    output, token_chars) lie within the first `sent` characters that went out: a token's logprob goes out
    with its text, and text held back (it may start a stop string) holds back its tokens' logprobs."""
    count = 0
    for token in tokens:
        before += token_chars(token)
        if before > sent:
            break
        count += 1
    return count


def tokens_started(tokens: list[str], before: int, total: int) -> int:
    """How many of `tokens` (their texts, starting `before` characters into the output) start within its first
    `total` characters: at the end of a request, the tokens whose logprobs it reports. The tokens of a stop string
    the text was cut at (and the EOS token's) lie past the text's end; a token the cut splits still counts."""
    count = 0
    for token in tokens:
        if before >= total:
            break
        before += token_chars(token)
        count += 1
    return count


def token_name(texts: dict[int, str], as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or with vLLM's return_tokens_as_token_ids "token_id:N" (a text that
    is part of a character or not JSON-clean still identifies the token)."""
    return (lambda tid: f"token_id:{tid}") if as_ids else texts.__getitem__


def chat_logprobs(tokenizer: Any, entries: list, as_ids: bool = False, texts: dict[int, str] | None = None) -> dict:
    """The chat `logprobs` object: each token's text (U+FFFD for part of a character, as it decodes alone) and its
    own raw bytes, which join back into the characters a token splits. `texts`: token_texts' when known."""
    texts = texts if texts is not None else token_texts(tokenizer, entries)
    raw = token_bytes(tokenizer, logprob_token_ids(entries), texts)  # `texts` may cover tokens still held back
    name = token_name(texts, as_ids)
    content = []
    for entry in entries:
        content.append({
            "token": name(entry.token_id), "logprob": safe_logprob(entry.logprob), "bytes": raw[entry.token_id],
            "top_logprobs": [{"token": name(tid), "logprob": safe_logprob(lp), "bytes": raw[tid]}
                             for tid, lp in entry.top],
        })
    return {"content": content}


def completion_logprobs(tokenizer: Any, entries: list, offset: int, as_ids: bool = False,
                        texts: dict[int, str] | None = None, textless: frozenset[int] = frozenset()) -> dict:
    """The legacy completions `logprobs` object; an entry with logprob None (an echoed prompt's first
    token, which nothing scores) gets null logprobs, as OpenAI's API gives it. Each top_logprobs entry names the
    chosen token first, then the alternatives: OpenAI's "up to logprobs + 1 elements", so `logprobs: 0` still
    gives the chosen token's and a chosen token outside the top k is there too. text_offset counts the tokens'
    texts whatever names them (`as_ids`)."""
    texts = texts if texts is not None else token_texts(tokenizer, entries)
    name = token_name(texts, as_ids)
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        tokens.append(name(entry.token_id))
        token_logprobs.append(None if entry.logprob is None else safe_logprob(entry.logprob))
        if entry.logprob is None:
            top.append(None)
        else:
            chosen = {name(entry.token_id): safe_logprob(entry.logprob)}
            # an alternative spelled like the chosen token (another id, the same text) does not overwrite it
            alternatives = {name(tid): safe_logprob(lp) for tid, lp in entry.top if tid != entry.token_id}
            top.append(chosen | {key: lp for key, lp in alternatives.items() if key not in chosen})
        offsets.append(offset)
        offset += 0 if entry.token_id in textless else token_chars(texts[entry.token_id])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
