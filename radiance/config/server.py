"""The OpenAI-compatible HTTP server's knobs (`radiance serve`): ServerConfig."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from radiance.config.validation import check
from radiance.config_types import check_types as _check_types
from radiance.errors import ConfigError


def _json_list_form(values: tuple[str, ...], name: str) -> tuple[str, ...]:
    """vLLM's form of a list flag, one JSON list (`--allowed-origins '["*"]'`), as the values it lists; taken as
    one literal value, it would match nothing."""
    if len(values) != 1 or not values[0].lstrip().startswith("["):
        return values
    try:
        listed = json.loads(values[0])
    except ValueError:
        raise ConfigError(f"{name}: {values[0]!r} is neither a value nor a JSON list of strings") from None
    check(isinstance(listed, list) and all(isinstance(v, str) for v in listed),
           f"{name}: {values[0]!r} is no JSON list of strings")
    return tuple(listed)


TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder", "glm45", "llama3_json", "mistral", "harmony", "none")
REASONING_PARSERS = ("auto", "think", "mistral", "harmony", "none")
# vLLM's names of the same parsers, so that a `vllm serve` command line's flags serve as they are
VLLM_TOOL_CALL_PARSERS = {"openai": "harmony", "glm47": "glm45"}
VLLM_REASONING_PARSERS = {"qwen3": "think", "deepseek_r1": "think", "glm45": "think", "openai_gptoss": "harmony",
                          "gpt_oss": "harmony"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
GENERATION_CONFIGS = ("auto", "none", "vllm")  # vllm: vLLM's name for none
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format values


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server (`radiance serve`)."""

    host: str = "127.0.0.1"  # interface to listen on; 0.0.0.0 for every interface
    port: int = 8000  # TCP port of the HTTP API; 0: a free one (the startup lines name it)
    served_model_name: tuple[str, ...] = ()  # first = the name, the rest aliases (each once); default from the model
    api_key: str | None = None  # when set, every route but /health, /metrics, /version and /ping needs `Authorization: Bearer KEY` (printable ASCII)
    chat_template: str | None = None  # a jinja file (or literal template) overriding the model's; default: the model's own
    # how a message's content reaches the template (vLLM's --chat-template-content-format): string (text parts joined
    # by newlines), openai (a list of {"type": "text", "text": ...} parts); auto: openai for a template that loops over a
    # message's content, else string
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False  # render a request's own `chat_template` (vLLM's field); off: such a request is a 400, since a template is code the server runs
    # a request's tools stay out of its prompt when its tool_choice is "none" (the model's default template, not its
    # tool_use one: the rendering before vLLM's flag of this name); off: rendered, as vLLM and OpenAI do (the model
    # knows its tools and calls none: no call is parsed out of its answer)
    exclude_tools_when_tool_choice_none: bool = False
    tool_call_parser: str = "auto"  # hermes, qwen3_coder, glm45, llama3_json, mistral, harmony (vLLM's openai), none; auto: the template's markup
    reasoning_parser: str = "auto"  # think (vLLM's qwen3, deepseek_r1), mistral, harmony (openai_gptoss), none; auto: from the template (<|channel|>: harmony, [THINK]: mistral, <think>: think)
    # auto: the sampling defaults of the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty) fill what a request leaves out and its max_new_tokens caps the output, as vLLM does;
    # none (or vllm, vLLM's name for it): OpenAI's defaults (temperature 1 ...)
    generation_config: str = "auto"
    max_logprobs: int = 20  # upper bound of logprobs / top_logprobs a request may ask for, in [0, 20] (OpenAI's limit: it only lowers it)
    max_n: int = 16  # upper bound of `n` (each choice is one engine request)
    responses_store: int = 1000  # /v1/responses kept in memory for previous_response_id and GET; 0 = none
    # the most bytes (as JSON) the stored /v1/responses take, oldest dropped first, one larger not kept; 0 = none.
    # Each keeps its whole input history: under the count alone a previous_response_id chain grows without end
    responses_store_bytes: int = 256 << 20
    # the start of every /metrics name: "vllm:" exports vLLM's names (vllm:num_requests_waiting, ...), which its
    # Grafana dashboard and autoscaling rules read
    metrics_prefix: str = "radiance_"
    uvicorn_log_level: str = "warning"  # log level of uvicorn's own access and error logs: critical, error, warning, info, debug, trace
    allowed_origins: tuple[str, ...] = ()  # origins whose web pages may call the API from a browser (CORS), e.g. https://chat.example.com, or * for any; default: pages of localhost / 127.0.0.1 / [::1] on any port
    ssl_keyfile: str | None = None  # serve HTTPS: the private key (PEM), with ssl_certfile
    ssl_certfile: str | None = None  # serve HTTPS: the certificate chain (PEM) of ssl_keyfile
    # serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), which
    # load any adapter path the server can read; default off: the routes answer 404 as unknown routes do
    allow_runtime_lora_updating: bool = False

    def __post_init__(self):
        _check_types(self)
        # an empty host (an unset shell variable) would listen on every interface
        check(self.host.strip() != "",
               f"host must be non-empty (0.0.0.0 listens on every interface), got {self.host!r}")
        check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port!r}")
        check(self.uvicorn_log_level.lower() in UVICORN_LOG_LEVELS,
               f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}, got {self.uvicorn_log_level!r}")
        # frozen: the vLLM name becomes ours as the dataclass is made
        object.__setattr__(self, "tool_call_parser", VLLM_TOOL_CALL_PARSERS.get(self.tool_call_parser,
                                                                                self.tool_call_parser))
        object.__setattr__(self, "reasoning_parser", VLLM_REASONING_PARSERS.get(self.reasoning_parser,
                                                                                self.reasoning_parser))
        check(self.tool_call_parser in TOOL_CALL_PARSERS, f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        check(self.reasoning_parser in REASONING_PARSERS, f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        check(0 <= self.max_logprobs <= 20, f"max_logprobs must be in [0, 20], got {self.max_logprobs!r}")
        check(self.max_n >= 1, f"max_n must be positive, got {self.max_n!r}")
        check(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", self.metrics_prefix) is not None,
               f"metrics_prefix must start a Prometheus metric name (letters, digits, _ and :), got "
               f"{self.metrics_prefix!r}")
        check(self.chat_template_content_format in CONTENT_FORMATS, f"chat_template_content_format must be one of "
               f"{CONTENT_FORMATS}, got {self.chat_template_content_format!r}")
        check(self.generation_config in GENERATION_CONFIGS,
               f"generation_config must be one of {GENERATION_CONFIGS}, got {self.generation_config!r}")
        check(self.responses_store >= 0, f"responses_store must be >= 0, got {self.responses_store!r}")
        check(self.responses_store_bytes >= 0,
               f"responses_store_bytes must be >= 0, got {self.responses_store_bytes!r}")
        check(all(name for name in self.served_model_name),
               f"served_model_name entries must be non-empty, got {self.served_model_name!r}")
        _check_distinct(self.served_model_name, "served_model_name")
        check((self.ssl_keyfile is None) == (self.ssl_certfile is None),
               f"HTTPS needs both ssl_keyfile and ssl_certfile (or neither, for HTTP), got {_lone_ssl_file(self)}")
        object.__setattr__(self, "allowed_origins", _json_list_form(self.allowed_origins, "allowed_origins"))
        check(all(origin for origin in self.allowed_origins),
               f"allowed_origins entries must be non-empty, got {self.allowed_origins!r}")
        check(self.api_key is None or self.api_key != "", "api_key must be non-empty when given, got ''")
        check(self.api_key is None or _HEADER_TOKEN.fullmatch(self.api_key) is not None,
               "api_key must be printable ASCII without leading or trailing spaces: the Authorization header "
               "carries it, and clients strip the spaces (a key of spaces or a newline could never match), got "
               f"{_api_key_fault(self.api_key or '')}")


# printable ASCII, inner spaces allowed: what an HTTP header value carries unchanged
_HEADER_TOKEN = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def _api_key_fault(key: str) -> str:
    """What is wrong with an API key, without the key: a message may reach a log others read."""
    odd = next((i for i, ch in enumerate(key) if not "\x20" <= ch <= "\x7e"), None)
    if odd is not None:
        return f"a key of {len(key)} characters whose character {odd + 1} is {_char_name(key[odd])}"
    return f"a key of {len(key)} characters with a leading or trailing space"


def _char_name(ch: str) -> str:
    return f"U+{ord(ch):04X}" + (" (a control character)" if ord(ch) < 0x20 or ord(ch) == 0x7f else "")


def _lone_ssl_file(config: ServerConfig) -> str:
    return "ssl_keyfile without ssl_certfile" if config.ssl_certfile is None else "ssl_certfile without ssl_keyfile"


def _check_distinct(values: tuple[str, ...], name: str) -> None:
    """A name given twice is a typo (two names meant) or a copy: either way /v1/models would list it twice."""
    repeated = sorted({v for v in values if values.count(v) > 1})
    check(not repeated, f"{name} lists {', '.join(map(repr, repeated))} more than once")
