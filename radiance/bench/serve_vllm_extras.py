"""`vllm bench serve`'s --backend, --dataset-name custom (--custom-output-len, --skip-chat-template) and
--save-detailed on `radiance bench serve`: their flags, and the options they set.

Kept apart from the load generator so that the CLI imports it without httpx."""

from __future__ import annotations

import argparse
from pathlib import Path

from radiance.bench.serve_backend import VLLM_BACKENDS
from radiance.bench.serve_options import SERVE_DEFAULTS
from radiance.errors import ConfigError

_DETAILED_HELP = "input_lens, output_lens, ttfts, itls, start_times, generated_texts, errors"


def _custom_output_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or -1, got {text!r}") from None
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or -1, got {value}")
    return value


def add_vllm_extra_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's backends, custom dataset and detailed results")
    g.add_argument("--backend", help=f"vLLM's backend, one of {', '.join(VLLM_BACKENDS)}: openai and vllm send "
                                     "completions to --endpoint (vLLM's default /v1/completions), openai-chat chat "
                                     "requests (with --endpoint /v1/chat/completions, as vLLM needs); the result's "
                                     "\"backend\" (default: openai, or openai-chat for --endpoint chat)")
    g.add_argument("--custom-output-len", type=_custom_output_len,
                   help="max_tokens of each --dataset-name custom request; -1: each line's \"output_tokens\" "
                        f"(default: {SERVE_DEFAULTS['custom_output_len']}, vLLM's; --output-len overrides it)")
    g.add_argument("--skip-chat-template", action="store_true",
                   help="send --dataset-name custom prompts as written (default: off: each is put in the model's "
                        "chat template first, rendered by the server's /tokenize and /detokenize, as vLLM renders "
                        "it with its tokenizer)")
    g.add_argument("--save-detailed", action="store_true",
                   help=f"keep vLLM's per-request lists ({_DETAILED_HELP}) in the --save-result file or --json "
                        "output (default: off: left out as vLLM leaves them out; latencies and queue_times stay "
                        "on a vLLM line, as in vLLM's file)")


def vllm_extra_options(args, endpoint: str | None) -> dict:
    """ServeBenchOptions fields of these flags. `endpoint` is --endpoint as given: vLLM's --backend does not pick
    the route, its default /v1/completions stands (ServeBenchOptions checks that the backend suits it)."""
    custom = args.dataset_name == "custom"
    if not custom and (args.custom_output_len is not None or args.skip_chat_template):
        flag = "--custom-output-len" if args.custom_output_len is not None else "--skip-chat-template"
        raise ConfigError(f"{flag} is the custom dataset's (--dataset-name custom --dataset-path FILE.jsonl), "
                          f"got --dataset-name {args.dataset_name or 'none'}")
    if args.save_detailed and not (args.save_result or args.json):
        raise ConfigError("--save-detailed keeps the per-request lists in the --save-result file (or the --json "
                          "output), neither of which is given")
    out = {"backend": args.backend, "save_detailed": args.save_detailed, "custom_dataset": custom,
           "skip_chat_template": args.skip_chat_template,
           "endpoint": endpoint or SERVE_DEFAULTS["endpoint"]}
    if custom:  # vLLM's --output-len overrides --custom-output-len
        given = next((v for v in (args.output_len, args.custom_output_len) if v is not None), None)
        out["custom_output_len"] = given if given is not None else SERVE_DEFAULTS["custom_output_len"]
    return out


def custom_dataset(args) -> str | None:
    """--dataset-name custom's file: --dataset-path (or radiance's --dataset), checked to exist before any request;
    None for any other dataset."""
    if args.dataset_name != "custom":
        return None
    if args.dataset and args.dataset_path:
        raise ConfigError("--dataset and vLLM's --dataset-path name the file twice: give one")
    path = args.dataset_path or args.dataset
    if not path:  # vLLM: "dataset_path must be provided for loading data."
        raise ConfigError("--dataset-name custom needs --dataset-path FILE.jsonl (one JSON object a line with a "
                          "\"prompt\")")
    if not Path(path).is_file():
        raise ConfigError(f"dataset file not found: {path}")
    return path
