"""vLLM's custom dataset (`--dataset-name custom --dataset-path FILE.jsonl`, vllm/benchmarks/datasets CustomDataset):
one JSON object a line with a "prompt", shuffled as vLLM shuffles it, each prompt wrapped in the model's chat
template on the client (unless --skip-chat-template) and sent as it comes out.

vLLM renders the template with its local tokenizer; here the server renders it (/tokenize with the prompt as one
user message, then /detokenize: vLLM's routes, radiance serve's too), so the text is the one the server's own
template makes, without a tokenizer download."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx

from radiance.bench.serve_prompts import PromptSpec, count_tokens, dataset_text
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)

CUSTOM_SHUFFLE_SEED = 0  # vLLM builds its CustomDataset without --seed: BenchmarkDataset's DEFAULT_SEED shuffles it
_PARALLEL_CALLS = 16  # /tokenize and /detokenize calls in flight while the prompts are prepared


def load_custom_dataset(path: str, output_len: int, shuffle: bool = True) -> list[PromptSpec]:
    """The file's prompts, shuffled as vLLM's `random.seed(0); random.shuffle(rows)` shuffles them unless `shuffle`
    is off (--disable-shuffle). `output_len` is every request's max_tokens; -1 takes each line's "output_tokens"
    (vLLM's --custom-output-len -1). Blank lines are skipped; any other line that is not a JSON object with a text
    "prompt" is an error naming its line."""
    if not path.lower().endswith(".jsonl"):  # vLLM: "Only JSONL format is supported for CustomDataset."
        raise ConfigError(f"--dataset-name custom reads a JSONL file (*.jsonl, one JSON object a line), as vLLM's "
                          f"custom dataset does, got {path}")
    text = dataset_text(path)
    specs = [_custom_row(line, output_len, f"dataset {path} line {n}")
             for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not specs:
        raise ConfigError(f"dataset {path} has no prompts (one JSON object a line with a \"prompt\")")
    if shuffle:
        random.Random(CUSTOM_SHUFFLE_SEED).shuffle(specs)
    return specs


def _custom_row(line: str, output_len: int, where: str) -> PromptSpec:
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with a \"prompt\", got {line.strip()[:60]}")
    if "prompt" not in row:
        raise ConfigError(f"{where}: no \"prompt\" field (vLLM's custom dataset reads one a line), "
                          f"got the fields {', '.join(map(repr, row)) or 'none'}")
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r:.60}")
    return PromptSpec(prompt, output_len if output_len != -1 else _output_tokens(row, where))


def _output_tokens(row: dict, where: str) -> int:
    """A line's "output_tokens", read as vLLM reads it (int(...): 12 or "12") with --custom-output-len -1."""
    if "output_tokens" not in row:
        raise ConfigError(f"{where}: no \"output_tokens\" field, which --custom-output-len -1 takes as the "
                          "request's max_tokens (give the field, or --custom-output-len N)")
    value = row["output_tokens"]
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer() or isinstance(value, str) and value.strip().isdigit():
        n = int(value)
    if n is None or n < 1:
        raise ConfigError(f"{where}: \"output_tokens\" must be a positive integer, got {value!r}")
    return n


async def prepare_custom_prompts(client: httpx.AsyncClient, model: str, specs: list[PromptSpec],
                                 chat_template: bool) -> list[PromptSpec]:
    """vLLM's CustomDataset.sample: each prompt in the chat template (a user message and the generation prompt),
    unless `chat_template` is off, and its token count with the tokenizer's special tokens (vLLM's
    `len(tokenizer(prompt).input_ids)`, its input length where the server reports no usage)."""
    gate = asyncio.Semaphore(_PARALLEL_CALLS)

    async def one(spec: PromptSpec) -> PromptSpec:
        async with gate:
            prompt = await _in_chat_template(client, model, spec.prompt) if chat_template else spec.prompt
            return PromptSpec(prompt, spec.output_len, prompt_len=await count_tokens(client, model, prompt, True))

    done = await asyncio.gather(*(one(spec) for spec in specs), return_exceptions=True)  # none left running
    failures = [r for r in done if isinstance(r, BaseException)]
    if not failures:
        return list(done)
    exc = failures[0]
    if not isinstance(exc, ConfigError):
        raise exc
    if chat_template:
        raise ConfigError(f"{exc}; the custom dataset's chat template is rendered by the server's /tokenize "
                          "and /detokenize (pass --skip-chat-template to send the prompts as written)") from None
    # the prompts go as written: only their client-side counts are missing (the server's usage has them)
    logger.warning("%s: the custom prompts' input lengths are the server's usage only", exc)
    return specs


async def _in_chat_template(client: httpx.AsyncClient, model: str, prompt: str) -> str:
    """The prompt as the server's chat template renders it for one user message, with the generation prompt
    (apply_chat_template(..., add_generation_prompt=True, tokenize=False)), as text."""
    tokens = await _post(client, "/tokenize", {"model": model, "add_generation_prompt": True,
                                               "messages": [{"role": "user", "content": prompt}]}, "tokens")
    return await _post(client, "/detokenize", {"model": model, "tokens": tokens}, "prompt")


async def _post(client: httpx.AsyncClient, path: str, body: dict, key: str):
    try:
        resp = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise ConfigError(f"could not reach the server's {path} ({type(exc).__name__}: {exc})") from None
    if resp.status_code != 200:
        raise ConfigError(f"the server's {path} answered HTTP {resp.status_code} "
                          f"({' '.join(resp.text.split())[:120]})")
    try:
        value = resp.json()[key]
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"the server's {path} answer has no {key!r}: {' '.join(resp.text.split())[:120]}") from None
    return value

