"""What the routes share: the engine (loaded in the background), served names, template, parsers.

The engine loads in a daemon thread after the HTTP server is up, so `/health` can answer 503 while
weights load and the event loop never blocks. Attributes the ARCHITECTURE contract puts on the
synchronous `LLMEngine` (tokenizer, max_model_len, chat_template, model_name, stats, load_summary)
are looked up on the async engine first and on its inner `.engine` otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from radiance.config import ServerConfig
from radiance.errors import ConfigError, RadianceError
from radiance.engine.tool_grammars import ToolCallMarkup, call_markup
from radiance.server.chat_template import load_template, template_features
from radiance.checkpoint import model_name
from radiance.checkpoint.sampling_defaults import SamplingDefaults
from radiance.engine.loader import no_tokenizer_message
from radiance.server.errors import OpenAIError
from radiance.server.lora_adapters import ServedAdapters
from radiance.server.metrics import ServerMetrics
from radiance.server.response_store import ResponseStore

logger = logging.getLogger(__name__)

class ServedEngine(Protocol):
    """What the server reads of its engine: AsyncLLMEngine, or a test's scripted stand-in."""

    tokenizer: Any
    tokenizer_error: str | None  # why there is no tokenizer (None when there is one)
    vocab_size: int
    max_model_len: int
    chat_template: str | None
    chat_templates: dict[str, str]  # named templates; "tool_use" serves requests with tools
    model_name: str
    load_summary: list[str]
    errored: BaseException | None  # the engine loop stopped after this error

    def stats(self) -> Any: ...

    async def check_structured_output(self, spec: Any) -> None: ...

    # lora_request: passed only for a request that names an adapter (the engine's lora_enabled, list_loras,
    # add_lora and remove_lora serve those; an engine without them serves no adapters)
    def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, **lora_request: Any) -> Any: ...

    def abort(self, request_id: str) -> None: ...


def default_model_name(model_path: str | None, engine: Any = None) -> str:
    if model_path:
        return model_name(model_path)
    return (engine.model_name if engine is not None else None) or model_name(None)


# "auto" parsers: the first whose template feature (chat_template.template_features) the model's templates show.
# Reasoning: harmony and Magistral's [THINK] first, since their markers are the models' own tokens, while <think>
# could appear in any template's text. Every parser of the two registries is listed (tests/server/test_tool_parsers).
AUTO_REASONING_PARSERS = (("harmony", "harmony"), ("mistral", "mistral_think"), ("think", "think"))
AUTO_TOOL_PARSERS = (("harmony", "harmony"), ("qwen3_coder", "qwen3_coder"), ("glm45", "glm45"), ("hermes", "hermes"),
                     ("mistral", "mistral"), ("llama3_json", "llama3_json"))


def auto_parsers(templates: str) -> tuple[str | None, str | None]:
    """(reasoning parser, tool-call parser) that "auto" picks for these chat templates (None: none fits)."""
    features = template_features(templates)
    reasoning = next((parser for parser, feature in AUTO_REASONING_PARSERS if features[feature]), None)
    tools = next((parser for parser, feature in AUTO_TOOL_PARSERS if features[feature]), None)
    return reasoning, tools


class ServerState:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Any], model_path: str | None = None):
        self.config = config
        self.engine_factory = engine_factory
        self.model_path = model_path
        self.engine: ServedEngine | None = None
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.served_names: tuple[str, ...] = config.served_model_name or (default_model_name(model_path),)
        self.tokenizer: Any = None
        self.tokenizer_error: str | None = None  # why the model has no tokenizer (file, field), for its 400s
        self.max_token_chars: int | None = None  # the longest token's text, for serving_common.encode_prompt
        self.max_model_len: int = 0
        self.chat_template: str | None = None
        self.tool_chat_template: str | None = None  # the model's "tool_use" template, for requests with tools
        self.tool_parser_name: str | None = None
        self.tool_call_markup: ToolCallMarkup | None = None  # how the template writes calls (forced and strict)
        # what a request's omitted sampling fields take (--generation-config auto: the model's recommendation)
        self.sampling_defaults = SamplingDefaults()
        self.reasoning_parser_name: str | None = None
        self.adapters = ServedAdapters()  # the LoRA adapters served as models (lora_adapters)
        self.metrics = ServerMetrics(self.stats, lambda: self.served_names[0], config.metrics_prefix,
                                     lambda: self.max_model_len)
        # /v1/responses answers, for follow-ups
        self.responses = ResponseStore(config.responses_store, config.responses_store_bytes)
        self._load_thread: threading.Thread | None = None
        # one thread, as vLLM's tokenizer executor: the tokenizer is never entered twice at once
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radiance-tokenize")

    # ------------------------------------------------------------ loading

    async def load(self) -> None:
        try:
            engine = await self._build_engine_in_daemon_thread()
            self.attach(engine)
        except asyncio.CancelledError:  # the server stops while loading: no failure of the model's
            raise
        except BaseException as exc:  # reported by /health (503) and by whoever awaits load()
            self.load_error = exc
            if not isinstance(exc, RadianceError):
                logger.exception("model failed to load")
            raise

    def _build_engine_in_daemon_thread(self) -> asyncio.Future:
        """engine_factory() in a daemon thread, not asyncio.to_thread: asyncio.run's end joins the default
        executor's threads (and the interpreter's exit joins them too), so Ctrl+C during a load of minutes waited
        for the load to finish. A result that comes after the server stopped is dropped."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():  # cancelled: the server stopped while loading
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def build() -> None:
            result, error = None, None
            try:
                result = self.engine_factory()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                error = exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is closed: the server stopped while loading
                pass

        self._load_thread = threading.Thread(target=build, name="radiance-load", daemon=True)
        self._load_thread.start()
        return future

    @property
    def loading(self) -> bool:
        """The load thread still runs (it cannot be interrupted; Ctrl+C leaves it behind)."""
        return self._load_thread is not None and self._load_thread.is_alive()

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the tokenizer thread. Rendering and tokenizing a long prompt (~1 s for 600k
        characters on a 2-core CPU) on the event loop held up every other request's stream and /health; the
        Rust tokenizer lets go of the GIL while it encodes."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    async def shutdown(self) -> None:
        """The server stops: the engine's loop and threads stop (an engine without `shutdown` has nothing to stop)."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            await shutdown()

    def attach(self, engine: ServedEngine) -> None:
        self.tokenizer = engine.tokenizer
        self.tokenizer_error = engine.tokenizer_error
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self.max_model_len = int(engine.max_model_len)
        self.chat_template = load_template(self.config.chat_template) or engine.chat_template
        # a model's named tool_use template serves requests with tools, unless --chat-template replaced them all
        named = {} if self.config.chat_template else engine.chat_templates
        self.tool_chat_template = named.get("tool_use")
        if not self.config.served_model_name:
            self.served_names = (default_model_name(self.model_path, engine),)
        templates = "\n".join(filter(None, (self.chat_template, self.tool_chat_template)))
        reasoning, markup = auto_parsers(templates)
        self.reasoning_parser_name = self._pick(self.config.reasoning_parser, reasoning)
        self.tool_parser_name = self._pick(self.config.tool_call_parser, markup)
        self._check_harmony_calls()
        self.tool_call_markup = call_markup(self.tool_parser_name, templates)
        if self.config.generation_config == "auto":
            self.sampling_defaults = getattr(engine, "sampling_defaults", SamplingDefaults())
        self.adapters.attach(engine)
        shadowed = [name for name in self.adapters.names() if name in self.served_names]
        if shadowed:  # check_model takes the base first: requests naming them never reach the adapter
            logger.warning("LoRA adapter name(s) %s are served model names too: requests naming them run on the base "
                           "model (give the adapters other names)", ", ".join(shadowed))
        self.engine = engine  # last: `ready` flips only once everything above is set

    def _check_harmony_calls(self) -> None:
        """Harmony calls reach the tool parser through the harmony reasoning parser, which reads the headers
        that name a message's recipient: without it there are none to parse."""
        if self.tool_parser_name != "harmony" or self.reasoning_parser_name == "harmony":
            return
        if self.config.tool_call_parser == "auto":
            self.tool_parser_name = None
            return
        raise ConfigError("--tool-call-parser harmony needs the harmony reasoning parser (--reasoning-parser "
                          f"harmony or auto with a harmony template), not {self.reasoning_parser_name or 'none'}")

    @staticmethod
    def _pick(flag: str, auto: str | None) -> str | None:
        if flag == "none":
            return None
        return auto if flag == "auto" else flag

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def startup_lines(self) -> list[str]:
        # the engine already logged its load summary (model, linears, kernels, KV cache) while loading
        lines = []
        names = ", ".join(self.served_names)
        lines.append(f"served model name(s): {names}; max_model_len {self.max_model_len}")
        if self.adapters.names():
            lines.append(f"LoRA adapters served as models: {', '.join(self.adapters.names())}")
        lines.append(f"tool-call parser: {self.tool_parser_name or 'none'}; "
                     f"reasoning parser: {self.reasoning_parser_name or 'none'}; "
                     f"chat template: {'yes' if self.chat_template else 'none (chat completions unavailable)'}")
        if self.sampling_defaults.given():
            lines.append(f"sampling defaults from the model's generation_config.json: "
                         f"{self.sampling_defaults.describe()} (where a request gives none; --generation-config none: "
                         f"OpenAI's)")
        return lines

    # ------------------------------------------------------------ per request

    def engine_failed(self) -> bool:
        """The engine loop stopped after an error (AsyncLLMEngine.errored): requests cannot succeed."""
        return self.engine is not None and self.engine.errored is not None

    def require_engine(self) -> ServedEngine:
        if self.engine is None:
            message = "the model failed to load" if self.load_error else "the model is still loading"
            raise OpenAIError(503, message)
        if self.engine_failed():
            raise OpenAIError(503, "the engine stopped after an internal error; restart the server")
        return self.engine

    def require_tokenizer(self, param: str | None = None,
                          hint: str = "only token-id prompts can be served (/v1/completions)") -> Any:
        """The tokenizer; without one (a GGUF whose tokenizer cannot be built) a 400 naming why, where touching
        None was a 500 "internal server error (AttributeError)"; token-id completions still serve."""
        if self.tokenizer is None:
            raise OpenAIError(400, no_tokenizer_message(self.tokenizer_error, hint), param=param)
        return self.tokenizer

    def check_model(self, name: str | None) -> str:
        """The served name a request addresses (None = the default): the base model's or a LoRA adapter's (its
        engine requests then carry lora_request(name)); 404 for any other name."""
        if name is None or name in self.served_names:
            return name or self.served_names[0]
        if self.adapters.get(name) is not None:
            return name
        # OpenAI's answer (404 invalid_request_error, code model_not_found), naming the served models too
        served = [*self.served_names, *self.adapters.names()]
        raise OpenAIError(404, f"The model `{name}` does not exist or you do not have access to it. "
                          f"Served: {', '.join(served)}", param="model", code="model_not_found")

    def lora_request(self, model: str) -> Any:
        """The LoRARequest of the model a request addresses (check_model's answer); None for the base model."""
        return None if model in self.served_names else self.adapters.for_engine(model)

    def stats(self):
        if self.engine is None:
            return None
        return self.engine.stats()

    def vocab_size(self) -> int:
        """The model's vocabulary (the engine checks prompt ids against the same number)."""
        return self.engine.vocab_size


def longest_token_chars(tokenizer: Any) -> int | None:
    """Characters in the vocabulary's longest token string (byte-level BPE: one per byte; SentencePiece: about
    one per character), so a text of n characters has at least n / this many tokens; None when the tokenizer
    shows no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return max((len(token) for token in get_vocab()), default=None)
    except Exception:  # a tokenizer without a usable vocabulary: no bound, tokenize as usual
        return None
