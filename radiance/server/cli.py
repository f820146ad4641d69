"""`radiance serve [MODEL]`: the OpenAI-compatible server on FastAPI + uvicorn.

Every engine config field is a flag (`radiance.config.add_engine_args`), as is every ServerConfig
field. The port opens at once; the model loads in the background (`/health` says 503 until it is
ready), then the startup summary is logged: model, quantization, kernels, KV cache size, URL.
"""

from __future__ import annotations

import argparse
import logging

from radiance.config import (ServerConfig, add_dataclass_args, add_engine_args, dataclass_kwargs,
                             engine_config_from_args)
from radiance.errors import ConfigError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF checkpoint directory or a GGUF file; default: the embedded "
                    "SmolLM2-135M-Instruct) over an OpenAI-compatible HTTP API.")
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory or .gguf file (default: the embedded SmolLM2)")
    add_engine_args(parser)
    add_dataclass_args(parser, ServerConfig, group="server options")
    parser.set_defaults(func=run_serve)


def configs_from_args(args: argparse.Namespace):
    """(EngineConfig, ServerConfig); bad values become ConfigError (one line, exit 2)."""
    given_model = getattr(args, "model", None)
    if args.model_path and given_model and args.model_path != given_model:
        raise ConfigError(f"two models given: positional {args.model_path!r} and --model {given_model!r}")
    try:
        engine_config = engine_config_from_args(args, model=args.model_path)
        server_config = ServerConfig(**dataclass_kwargs(args, ServerConfig))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return engine_config, server_config


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from radiance.server.api import build_app
    from radiance.server.state import ServerState

    engine_config, server_config = configs_from_args(args)

    def make_engine():
        from radiance.engine import AsyncLLMEngine
        return AsyncLLMEngine(engine_config)

    url = f"http://{server_config.host}:{server_config.port}"

    def on_ready(state: ServerState) -> None:
        for line in state.startup_lines():
            logger.info("%s", line)
        logger.info("ready: OpenAI-compatible API at %s/v1 (health %s/health, metrics %s/metrics)", url, url, url)

    state = ServerState(server_config, make_engine, model_path=engine_config.model.model)
    logger.info("loading %s; the API at %s answers /health with 503 until the model is ready",
                engine_config.model.model or "the embedded SmolLM2-135M-Instruct", url)
    server: uvicorn.Server | None = None

    def on_load_failure(_state: ServerState) -> None:
        server.should_exit = True  # nothing to serve: stop and report the error below

    app = build_app(state, on_ready=on_ready, on_load_failure=on_load_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level=server_config.uvicorn_log_level, timeout_graceful_shutdown=5))
    server.run()
    if state.load_error is not None:
        raise state.load_error  # a RadianceError prints as one line (exit 2); anything else is a bug
    return 0
