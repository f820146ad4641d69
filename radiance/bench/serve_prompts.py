"""The prompts `radiance bench serve` sends: random words of a given length, or a dataset file's prompts."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from radiance.bench.serve_bench import ServeBenchOptions


# Common short English words: each is about one token for BPE vocabularies, so a prompt of L
# words is close to L tokens on any model (the server's usage reports the exact count).
_WORDS = (
    "the of and to in is was for on as with by he at from his an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during "
    "into school time may years more most only over city some world would where later up such used many "
    "can state about national out known university united then made year three under since season well"
).split()


@dataclass(frozen=True)
class PromptSpec:
    prompt: str
    output_len: int
    # a ShareGPT conversation's answer (vLLM sizes max_tokens by it); not part of the request sent
    reply: str | None = field(default=None, compare=False)
    # the prompt's tokens by the server's /tokenize, where counted: vLLM's input tokens when no usage comes back
    prompt_len: int | None = field(default=None, compare=False)


def random_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[PromptSpec]:
    """n distinct prompts of input_len words (distinct so prefix caching cannot skip the prefill)."""
    rng = random.Random(seed)
    return [PromptSpec(" ".join(rng.choice(_WORDS) for _ in range(input_len)), output_len) for _ in range(n)]


def load_dataset(path: str, output_len: int, shuffle_seed: int | None = None,
                 vllm: bool = False) -> list[PromptSpec]:
    """A JSON array (ShareGPT's {"conversations": [...]} or {"prompt", "output_len"?} objects), JSONL lines
    {"prompt": str, "output_len": int?} or plain text lines (one prompt each), in the file's order.

    `vllm` (a vLLM line), as vLLM's ShareGPT loader: conversations of
    fewer than two turns dropped, the rows shuffled with `shuffle_seed` as `random.seed(seed); random.shuffle(rows)`
    does (None: kept in the file's order, vLLM's --disable-shuffle), and a conversation's first two turns taken as
    prompt and reply whoever speaks them; so the same file and --seed send vLLM's prompts."""
    rows = _dataset_rows(path, output_len)
    if vllm:
        rows = [(row, where) for row, where in rows if not _short_conversation(row)]
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(rows)
    specs = [spec for row, where in rows if (spec := _row_spec(row, output_len, where, vllm)) is not None]
    if not specs:
        raise ConfigError(f"dataset {path} has no prompts")
    return specs


def _dataset_rows(path: str, output_len: int) -> list[tuple[object, str]]:
    """The file's rows, each with where it is: a JSON array's items, else its non-blank lines (JSON objects parsed,
    any other line a prompt)."""
    text = dataset_text(path)
    array = _json_array(text, path)
    if array is not None:
        return [(item, f"dataset {path} item {i}") for i, item in enumerate(array)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"dataset {path} line {lineno}"
        # {"prompt", "output_len"?}, or a ShareGPT conversation a line
        rows.append((_json_line(line, where) if line.lstrip().startswith("{") else PromptSpec(line, output_len), where))
    return rows


def _short_conversation(row) -> bool:
    """A conversation vLLM's ShareGPT loader drops before its shuffle: fewer than two turns."""
    return isinstance(row, dict) and "conversations" in row and not (
        isinstance(row["conversations"], list) and len(row["conversations"]) >= 2)


def _row_spec(row, output_len: int, where: str, first_two_turns: bool) -> PromptSpec | None:
    if isinstance(row, PromptSpec):  # a text line
        return row
    if first_two_turns and isinstance(row, dict) and "conversations" in row:
        return _first_two_turns(row["conversations"], output_len)
    return _array_item(row, output_len, where)


def _first_two_turns(turns: list, output_len: int) -> PromptSpec | None:
    """vLLM's ShareGPT request: turn 0 is the prompt and turn 1 the reply, whoever speaks them (None when a turn
    holds no text)."""
    prompt, reply = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
    if not isinstance(prompt, str) or not prompt.strip() or not isinstance(reply, str):
        return None
    return PromptSpec(prompt, output_len, reply)


def dataset_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"dataset file not found: {path}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"dataset {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _json_array(text: str, path: str) -> list | None:
    """The file as one JSON array (ShareGPT's layout), None when it is lines. A .json file that starts like an
    array must parse: read as lines, a broken one would send its fragments as prompts."""
    if not text.lstrip().startswith("["):
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        if path.lower().endswith(".json"):
            raise ConfigError(f"dataset {path} is not valid JSON ({exc})") from None
        return None  # text lines, the first of which starts with "["


def _array_item(item, output_len: int, where: str) -> PromptSpec | None:
    """One {"prompt", "output_len"?} object, or a ShareGPT conversation's first human turn (None when it has none:
    ShareGPT holds some conversations that open with the model)."""
    if isinstance(item, dict) and "conversations" in item:
        turns = item["conversations"]
        if not isinstance(turns, list):
            raise ConfigError(f"{where}: 'conversations' must be a list of turns")
        at = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
        first = turns[at] if at is not None else None
        if first is None or not isinstance(first.get("value"), str) or not first["value"].strip():
            return None
        after = turns[at + 1] if at + 1 < len(turns) else None
        reply = after.get("value") if isinstance(after, dict) and isinstance(after.get("value"), str) else None
        return PromptSpec(first["value"], output_len, reply)
    return _prompt_row(item, output_len, where)


def _json_line(line: str, where: str):
    try:
        return json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: expected JSON with a 'prompt' field ({exc})") from None


def _prompt_row(row, output_len: int, where: str) -> PromptSpec:
    """One {"prompt", "output_len"?} object; a prompt that is not text or an output_len that is not a positive
    integer (null, 2.7, true, 0) is the file's error, not a request the server rejects or a str(None) prompt."""
    if not isinstance(row, dict) or "prompt" not in row:
        raise ConfigError(f"{where}: expected JSON with a 'prompt' field, got {str(row)[:60]}")
    prompt, n = row["prompt"], row.get("output_len", output_len)
    if not isinstance(prompt, str):
        raise ConfigError(f"{where}: 'prompt' must be a string, got {prompt!r}")
    if not prompt.strip():  # blank text lines are skipped; an empty prompt is a request no server answers alike
        raise ConfigError(f"{where}: 'prompt' is empty")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{where}: 'output_len' must be a positive integer, got {n!r}")
    return PromptSpec(prompt, n)


def oversample(pool: list[PromptSpec], n: int, seed: int) -> list[PromptSpec]:
    """vLLM's BenchmarkDataset.maybe_oversample_requests: a dataset with fewer prompts than requests is topped up
    with prompts drawn at random, with replacement, from `random.seed(seed)` (its --seed); the pool as it is when
    it holds enough."""
    if len(pool) >= n:
        return pool
    rng = random.Random(seed)  # random.seed(seed) then random.choice, as vLLM draws them
    logger.info("Oversampled requests to reach %d total samples.", n)  # vLLM's line
    return pool + [rng.choice(pool) for _ in range(n - len(pool))]


def prompts_for_level(opts: ServeBenchOptions, n: int, level_seed: int,
                      pool: list[PromptSpec] | None = None, start: int = 0) -> list[PromptSpec]:
    """The dataset's prompts in order from its `start`-th (cycled), else n random prompts."""
    if pool:
        return [pool[(start + i) % len(pool)] for i in range(n)]
    return random_prompts(n, opts.input_len, opts.output_len, level_seed)


# ------------------------------------------------------------------ token counts from the server (vLLM's lengths)

# vLLM's ShareGPT sampling keeps a conversation when its prompt and reply have 4 tokens or more, the prompt at most
# 1024 and both together at most 2048
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


async def count_tokens(client: httpx.AsyncClient, model: str, text: str, special_tokens: bool = False) -> int:
    """The text's token count by the server's tokenizer (vLLM's /tokenize, radiance serve's too): without special
    tokens (vLLM's random dataset counts a prompt's own tokens), or with them (`special_tokens`: a BOS for
    Llama-style tokenizers, as vLLM's ShareGPT sampling counts `tokenizer(text).input_ids`)."""
    try:
        resp = await client.post("/tokenize", json={"model": model, "prompt": text,
                                                    "add_special_tokens": special_tokens})
    except httpx.HTTPError as exc:  # a traceback said no more than this
        raise ConfigError(f"could not reach the server's /tokenize ({type(exc).__name__}: {exc}); "
                          "check --url") from None
    if resp.status_code != 200:
        raise ConfigError(f"the server's /tokenize answered HTTP {resp.status_code} "
                          f"({' '.join(resp.text.split())[:120]}); it counts the tokens of vLLM's lengths")
    try:
        count = resp.json()["count"]
    except (KeyError, TypeError, ValueError):
        count = None
    if isinstance(count, bool) or not isinstance(count, int):
        raise ConfigError(f"the server's /tokenize answer has no token count: {' '.join(resp.text.split())[:120]}")
    return count


async def special_tokens(client: httpx.AsyncClient, model: str) -> int:
    """The special tokens the server's tokenizer adds to a prompt (vLLM's `num_special_tokens_to_add`, a BOS for
    Llama-style tokenizers): a text's count with them less its count without."""
    probe = " ".join(_WORDS[:8])
    return max(0, await count_tokens(client, model, probe, special_tokens=True) - await count_tokens(client, model, probe))


def check_random_input_len(input_len: int, specials: int) -> None:
    """vLLM's RandomDataset refuses an input length that leaves no token of the prompt's own after the tokenizer's
    special tokens (it would send empty prompts); radiance sent one-word prompts, longer than asked."""
    if input_len - specials < 1:
        raise ConfigError(f"--random-input-len {input_len} is too small: the server's tokenizer adds {specials} "
                          f"special token(s), which leaves {input_len - specials} for the prompt's own; give at "
                          f"least {specials + 1} (vLLM refuses it too)")


async def fit_to_tokens(client: httpx.AsyncClient, model: str, specs: list[PromptSpec], input_len: int,
                        seed: int, specials: int | None = None) -> list[PromptSpec]:
    """Each random prompt made input_len tokens long as vLLM's random dataset makes them: its own tokens (counted
    without special tokens) are input_len less the special tokens the tokenizer adds (`num_special_tokens_to_add`,
    a BOS for Llama-style tokenizers: the server then reads input_len tokens). Its words are about one token each,
    so one step of the difference usually lands; else the longest run of words within that length (a binary
    search; exact unless a word of several tokens straddles the length). An input_len of no more than the special
    tokens is refused, as vLLM refuses it."""
    rng = random.Random(seed)
    out = []
    if specs:  # `specials`: counted once a run by the caller, else here
        specials = await special_tokens(client, model) if specials is None else specials
        check_random_input_len(input_len, specials)
        input_len -= specials
    for spec in specs:
        words = spec.prompt.split()
        n = await count_tokens(client, model, spec.prompt)
        if n != input_len:
            words = words[:max(1, len(words) - (n - input_len))] if n > input_len else \
                words + [rng.choice(_WORDS) for _ in range(input_len - n)]
            n = await count_tokens(client, model, " ".join(words))
        if n != input_len:
            while n < input_len:  # enough words to search within
                words += [rng.choice(_WORDS) for _ in range(input_len)]
                n = await count_tokens(client, model, " ".join(words))
            lo, hi = 1, len(words)  # the longest prefix of at most input_len tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if await count_tokens(client, model, " ".join(words[:mid])) <= input_len:
                    lo = mid
                else:
                    hi = mid - 1
            words = words[:lo]
            n = await count_tokens(client, model, " ".join(words))  # exact only unless a word straddled the length
        out.append(PromptSpec(" ".join(words), spec.output_len, prompt_len=n))
    return out


async def sharegpt_lengths(client: httpx.AsyncClient, model: str, pool: list[PromptSpec], needed: int,
                           output_len: int | None = None) -> list[PromptSpec]:
    """vLLM's ShareGPTDataset.sample: each conversation's max_tokens is its reply's token count (else `output_len`,
    vLLM's --sharegpt-output-len, for every request), and the conversations vLLM drops are left out: a prompt under
    4 tokens or over 1024, a reply under 4 (not checked with `output_len`), prompt and max_tokens over 2048 together.
    Prompt and reply are counted with the tokenizer's special tokens, as vLLM's `tokenizer(text).input_ids` counts
    them; counted only until `needed` are found (ShareGPT holds 90k conversations)."""
    out = []
    for spec in pool:
        if len(out) >= needed:
            break
        if output_len is None and not spec.reply:  # no reply to size by (an empty one has too few tokens)
            continue
        prompt_len = await count_tokens(client, model, spec.prompt, special_tokens=True)
        max_tokens = output_len if output_len is not None else \
            await count_tokens(client, model, spec.reply, special_tokens=True)
        if prompt_len < SHAREGPT_MIN_LEN or (output_len is None and max_tokens < SHAREGPT_MIN_LEN) \
                or prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + max_tokens > SHAREGPT_MAX_TOTAL:
            continue
        out.append(PromptSpec(spec.prompt, max_tokens, prompt_len=prompt_len))
    if not out:
        wanted = "a prompt and a reply of 4 to 1024 tokens, 2048 together" if output_len is None else \
            f"a prompt of 4 to 1024 tokens, {SHAREGPT_MAX_TOTAL} with the {output_len} asked for"
        raise ConfigError(f"the dataset has no conversation vLLM's sharegpt would send ({wanted})")
    return out
