"""`vllm bench serve`'s flags on `radiance bench serve`: the ones radiance honours with vLLM's meaning (mapped onto
radiance's options by bench/cli.serve_options), the ones it cannot (refused by name, with why), and vLLM's defaults
for a line written in its form."""

from __future__ import annotations

import argparse
import random

from radiance.bench.options import non_negative_int, positive_int
from radiance.bench.serve_options import DEFAULT_URL
from radiance.errors import ConfigError

_VLLM_REFUSED = {
    "--ramp-up-strategy": "radiance sends at one --request-rate (or one per level), not a ramp",
    "--ramp-up-start-rps": "radiance sends at one --request-rate, not a ramp",
    "--ramp-up-end-rps": "radiance sends at one --request-rate, not a ramp",
    "--profile": "radiance serve has no /start_profile",
    "--use-beam-search": "radiance has no beam search",
    "--logprobs": "radiance's load requests ask for no logprobs",
    "--append-result": "the result file is written whole (--save-result)",
    "--extra-body": "the request bodies are radiance's (--no-ignore-eos sends OpenAI's fields only)",
    "--header": "only Authorization is sent (--api-key)",
    "--metadata": "name the run with --label",
    "--served-model-name": "the model requested is --model",
    "--request-id-prefix": "radiance sends no request ids",
    "--top-p": "requests are greedy (temperature 0), vLLM's default",
    "--top-k": "requests are greedy (temperature 0), vLLM's default",
    "--min-p": "requests are greedy (temperature 0), vLLM's default",
    "--frequency-penalty": "requests carry no penalties",
    "--presence-penalty": "requests carry no penalties",
    "--repetition-penalty": "requests carry no penalties",
    "--common-prefix-len": "random prompts share no prefix",
    "--no-oversample": "a dataset with fewer prompts than requests is topped up with random draws, as vLLM's default",
}
# ones radiance honours at vLLM's default value only (anything else would change the measurement)
_VLLM_AT_DEFAULT = {"--burstiness": ("1", "arrivals are a Poisson process (vLLM's burstiness 1)"),
                    "--temperature": ("0", "requests are greedy (temperature 0), vLLM's default"),
                    "--random-range-ratio": ("0", "random prompts have exactly --random-input-len tokens"),
                    "--random-prefix-len": ("0", "random prompts share no prefix")}
VLLM_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's default --percentile-metrics
_VLLM_DATASETS = ("random", "sharegpt")
# the vLLM flags below mark a command line as vLLM's: one level (--max-concurrency, or every request at once) of
# --num-prompts (vLLM's default 1000) random prompts of vLLM's 1024 tokens
VLLM_FORM = ("base_url", "host", "port", "backend", "dataset_name", "dataset_path", "random_input_len",
              "random_output_len", "sharegpt_output_len", "max_concurrency", "num_warmups", "tokenizer",
              "save_result", "result_dir", "result_filename", "disable_tqdm", "vllm_ignore_eos", "disable_shuffle")


def is_vllm_command_line(args) -> bool:
    """Whether the parsed line is vLLM's (any flag of VLLM_FORM given): it then runs with vLLM's defaults, sampling
    and timing (ServeBenchOptions.vllm_form)."""
    return any(getattr(args, name, None) not in (None, False) for name in VLLM_FORM)


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        default = _VLLM_AT_DEFAULT.get(option_string)
        if default and values is not None and _same_number(values, default[0]):
            return
        why = default[1] if default else _VLLM_REFUSED[option_string]
        parser.error(f"vLLM's {option_string} is not supported: {why}")


def _same_number(values, expected: str) -> bool:
    try:
        return float(values if isinstance(values, str) else values[0]) == float(expected)
    except (ValueError, IndexError, TypeError):
        return False


def add_vllm_flags(p) -> None:
    g = p.add_argument_group("vLLM's bench serve flags",
                             "A `vllm bench serve` command line runs as it is, with vLLM's meaning: any flag of this "
                             "group makes it one level of --num-prompts requests (vLLM's default 1000) at "
                             "--max-concurrency (default: all at once), random prompts of --random-input-len tokens "
                             "(default 1024), fitted with the server's /tokenize, and vLLM's summary block.")
    g.add_argument("--base-url", help="server URL, as --url")
    g.add_argument("--host", help="server host when no --base-url (default: 127.0.0.1)")
    g.add_argument("--port", type=positive_int, help="server port when no --base-url (default: 8000)")
    g.add_argument("--max-concurrency", type=positive_int, help="one level of this many requests at most in flight "
                                                                 "(default: no limit)")
    g.add_argument("--dataset-name", help="random, sharegpt or custom (with --dataset-path) (default: random)")
    g.add_argument("--dataset-path", help="the ShareGPT file, as --dataset")
    g.add_argument("--random-input-len", type=positive_int, help="as --input-len, in tokens (default: 1024)")
    g.add_argument("--random-output-len", type=positive_int, help="as --output-len (default: 128)")
    g.add_argument("--sharegpt-output-len", type=positive_int,
                   help="max_tokens of every ShareGPT request; vLLM's length filter still drops prompts under 4 or "
                        "over 1024 tokens, or over 2048 with it (default: each reply's token count, by /tokenize)")
    g.add_argument("--disable-shuffle", action="store_true", default=None,
                   help="keep the dataset file's order; conversations of fewer than two turns are still dropped "
                        "(default: shuffled with --seed, as vLLM does)")
    g.add_argument("--num-warmups", type=non_negative_int,
                   help="uncounted copies of the run's first request sent before it, at most --max-concurrency at "
                        "once, their answers unchecked, as vLLM sends them (default: 0)")
    g.add_argument("--ready-check-timeout-sec", type=non_negative_int,
                   help="send the run's first request until it succeeds, for up to this many seconds, before the run "
                        "(default: 0, none, vLLM's)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="service-level objectives in ms (ttft, tpot, e2el): request_goodput counts the requests "
                        "within all of them a second (default: none, request_goodput null)")
    g.add_argument("--tokenizer", help="accepted: token counts come from the server's own tokenizer (/tokenize, usage)")
    g.add_argument("--tokenizer-mode", help="accepted, as --tokenizer")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted, as --tokenizer")
    g.add_argument("--ignore-eos", dest="vllm_ignore_eos", action="store_true", default=None,
                   help="send ignore_eos (radiance's default; vLLM's form sends it for random prompts or with this)")
    g.add_argument("--disable-tqdm", action="store_true", default=None, help="as --no-progress")
    g.add_argument("--save-result", action="store_true", default=None,
                   help="write the --json result to a file too: --result-dir / --result-filename, else vLLM's name "
                        "LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json")
    g.add_argument("--result-dir", help="directory of the --save-result file, made if missing (default: .)")
    g.add_argument("--result-filename", help="name of the --save-result file (default: vLLM's)")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME",
                   help="LoRA adapters the server serves (radiance serve --lora-modules, or loaded at runtime): each "
                        "measured request names one of them, drawn at random, as its model (warmups use the base "
                        "model, as vLLM's) (default: none, every request on --model)")
    for flag in (*_VLLM_REFUSED, *_VLLM_AT_DEFAULT):
        g.add_argument(flag, nargs="*", action=_Refused, help=argparse.SUPPRESS)


def request_models(lora_modules: tuple[str, ...], model: str, count: int, seed: int) -> list[str]:
    """The model each of `count` requests names: `model`, or with vLLM's --lora-modules one adapter of them per
    request, drawn at random (vLLM's random.choice per request) from `seed`, so a run is repeatable."""
    if not lora_modules:
        return [model] * count
    rng = random.Random(seed)
    return [rng.choice(lora_modules) for _ in range(count)]


def parse_goodput(pairs) -> tuple[tuple[str, float], ...]:
    """vLLM's --goodput KEY:MS pairs (ttft, tpot, e2el) as ServeBenchOptions.goodput."""
    out = []
    for pair in pairs or ():
        name, _, ms = pair.partition(":")
        try:
            out.append((name, float(ms)))
        except ValueError:
            raise ConfigError(f"--goodput takes KEY:MILLISECONDS pairs (ttft, tpot, e2el), got {pair!r}") from None
    return tuple(out)


def one_of(args, ours: str, theirs: str, default, vllm_default):
    """radiance's flag or vLLM's dataset-specific one (vLLM's general --input-len wins over --random-input-len)."""
    given = getattr(args, ours)
    if given is not None:
        return given
    if getattr(args, theirs) is not None:
        return getattr(args, theirs)
    return vllm_default if vllm_default is not None else default


def vllm_url(args) -> str:
    """--url, or vLLM's --base-url (which wins over --host / --port, as in vLLM), or http://HOST:PORT."""
    if args.url and (args.base_url or args.host or args.port):
        raise ConfigError("--url and vLLM's --base-url / --host / --port name the server twice: give one")
    if args.url or args.base_url:
        return args.url or args.base_url
    if args.host or args.port:
        host = args.host or "127.0.0.1"
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
        return f"http://{host}:{args.port or 8000}"
    return DEFAULT_URL


def vllm_dataset(args) -> str | None:
    name = args.dataset_name
    if name is not None and name not in _VLLM_DATASETS:
        raise ConfigError(f"vLLM's --dataset-name {name} is not supported: radiance sends random prompts, a "
                          "ShareGPT file (--dataset-name sharegpt --dataset-path FILE) or a JSONL file of prompts "
                          "(--dataset-name custom --dataset-path FILE.jsonl)")
    if args.dataset and args.dataset_path:
        raise ConfigError("--dataset and vLLM's --dataset-path name the file twice: give one")
    if name == "random" and args.dataset_path:  # vLLM refuses it too
        raise ConfigError("--dataset-name random takes no --dataset-path (give --dataset-name sharegpt)")
    if name == "sharegpt" and not args.dataset_path and not args.dataset:
        raise ConfigError("--dataset-name sharegpt needs --dataset-path FILE (radiance downloads nothing)")
    return args.dataset or args.dataset_path
