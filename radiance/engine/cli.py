"""`radiance generate "PROMPT"`: one prompt through the engine, the answer streamed to stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from radiance.config import check_seed
from radiance.config_cli import add_engine_args, engine_config_from_args, errors_in_flag_words
from radiance.engine.request_checks import check_fits_context, check_utf8
from radiance.errors import ConfigError, StructuredOutputError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt (offline, no server)",
                                   description="Generate text for one prompt with the model's chat template "
                                               "(the embedded SmolLM2 when --model is not given).")
    parser.add_argument("prompt", help="the user message (or raw text with --no-chat); - reads it from stdin")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens to generate at most; with the prompt they must fit the model's context "
                             "(max_model_len) (default: 64)")
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="tokens to generate before end-of-sequence may stop the output (default: 0)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature in [0, 2] (OpenAI's range); 0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probability reaches this; 1 = off (default)")
    parser.add_argument("--top-k", type=int, default=-1,
                        help="sample from the k most likely tokens only; 0 or -1 = off (default: -1)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this fraction of the most likely one; 0 = off (default)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the output where this text appears (cut before it); repeat for several")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="go on past the model's end-of-sequence token, to --max-tokens (benchmarks)")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of the sampler, for reproducible runs: a 64-bit signed integer, as a request's "
                             "seed; -1 is no seed (vLLM's), another negative one a seed of its own (default: none: the "
                             "engine's RNG, see --seed)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divides the positive logits (multiplies the negative ones) of tokens already in "
                             "the prompt or output; 1 = off (default), 1.1-1.3 curbs loops of small models")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="subtracted from a token's logit per time it is in the output, in [-2, 2] "
                             "(default: 0 = off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="subtracted once from the logit of every token in the output, in [-2, 2] "
                             "(default: 0 = off)")
    constrain = parser.add_argument_group(
        "structured output", "hold the output to one constraint (tokens that would break it are never sampled); an "
                             "output --max-tokens cuts before the constraint is complete is not valid: exit status 1")
    one = constrain.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="SCHEMA", default=None,
                     help="a JSON schema, as JSON text or the path of a .json file (true: any JSON value)")
    one.add_argument("--json", dest="json_object", action="store_true", help="any JSON object")
    one.add_argument("--regex", default=None, help="a regular expression the whole output matches")
    one.add_argument("--choice", nargs="+", default=None,
                     help="the output is exactly one of these strings (give the prompt first, or end the list with "
                          "-- and put the other options before --choice: the strings take every word after it)")
    one.add_argument("--grammar", metavar="FILE", default=None, help="an EBNF (GBNF) grammar file with a root rule")
    parser.add_argument("--chat", dest="chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the prompt in the model's chat template; --chat on a model without one is an "
                             "error (default: on when it has one)")
    parser.add_argument("--system", default=None,
                        help="a system message before the prompt, in chat mode (default: none)")
    parser.add_argument("--lora", metavar="NAME", default=None,
                        help="answer with this LoRA adapter of --lora-modules (name=path; needs --enable-lora) "
                             "(default: none, the base model)")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from radiance.engine.llm import LLM

    # the sampling options are checked before the model loads (a large one takes minutes); the loader checks
    # --device before anything else
    config = engine_config_from_args(args)
    if args.sampling_seed is not None:  # the engine wraps any int into 64 bits: 2**64 + 1 would sample as 1
        check_seed(args.sampling_seed, "--sampling-seed")
    params = sampling_params_from_args(args)
    lora_request = chosen_adapter(config, args.lora)
    if args.system is not None and args.chat is False:
        raise ConfigError("--system goes into the chat template, which --no-chat turns off")
    # text that is not UTF-8 reaches Python as lone surrogates, which the tokenizer met with a traceback
    if args.system is not None:
        check_utf8(args.system, "--system")
    # after the options' checks: a bad one must not wait for stdin
    prompt_text = read_prompt(args.prompt)
    check_utf8(prompt_text, "the prompt")
    checkpoint = _open_with_a_template_that_parses(config, use_template=args.chat is not False)
    _check_tokenizer(checkpoint)
    llm = LLM.from_engine_config(config, checkpoint=checkpoint, progress=not args.no_progress)
    has_template = bool(llm.engine.chat_template or getattr(llm.tokenizer, "chat_template", None))
    if args.chat and not has_template:  # was ignored: the raw prompt went in without a word
        raise ConfigError("--chat: the model has no chat template (--no-chat sends the prompt as raw text)")
    if args.chat is not False and has_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt_text})
        prompt = llm._encode(llm.apply_chat_template(messages), add_special_tokens=False)
    else:
        if args.system is not None:
            logger.warning("the model has no chat template: --system is left out, the prompt goes in as raw text")
        prompt = prompt_text
    return 0 if _stream(llm, prompt, params, lora_request) else 1


def chosen_adapter(config, name: str | None):
    """The LoRARequest of --lora NAME: the engine loads --lora-modules at start with ids 1, 2, ... in order. Checked
    before the model loads."""
    if name is None:
        return None
    from radiance.lora import LoRARequest

    modules = config.lora.parsed_modules()
    for i, (module, path) in enumerate(modules):
        if module == name:
            return LoRARequest(module, i + 1, path)
    if not modules:
        raise ConfigError(f"--lora {name!r}: no adapter to choose from; load it with --enable-lora "
                          f"--lora-modules {name}=PATH")
    raise ConfigError(f"--lora {name!r} is not one of the --lora-modules adapters: "
                      f"{', '.join(m for m, _ in modules)}")


def _open_with_a_template_that_parses(config, use_template: bool):
    """The checkpoint opened (headers) and, in chat mode, its chat template compiled: one that does not parse is
    refused, naming its file, before the weights load (minutes on a large model), not after."""
    from radiance.engine.loader import open_for_loading
    from radiance.server.chat_template import check_template

    checkpoint, _, _ = open_for_loading(config.model, config.cache)
    template = checkpoint.chat_template if use_template else None
    if template:
        check_template(template, checkpoint.template_source(template))
    return checkpoint


def _check_tokenizer(checkpoint) -> None:
    """generate's prompt is text, so a model without a tokenizer is refused before the weights load (the error came
    after every weight and the KV cache). The checkpoint keeps the tokenizer it builds: the load reuses it."""
    from radiance.engine.loader import no_tokenizer_message
    from radiance.errors import CheckpointError

    try:
        tokenizer, reason = checkpoint.tokenizer(), None
    except CheckpointError as exc:
        tokenizer, reason = None, str(exc)
    if tokenizer is None:
        raise ConfigError(no_tokenizer_message(reason, "radiance generate needs one to encode the prompt"))


def sampling_params_from_args(args):
    """The SamplingParams of the flags; an out-of-range value is named by its flag (--top-p, not top_p)."""
    from radiance.engine.sampling_params import SamplingParams

    given = dict(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                 top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                 stop=args.stop or [], ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                 frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    structured_output = structured_output_from_args(args)
    with errors_in_flag_words(given, flags={"seed": "--sampling-seed"}):
        return SamplingParams(**given, structured_output=structured_output)


def read_prompt(prompt: str) -> str:
    """The prompt argument, or stdin's text for "-" (a long or multi-line prompt from a file or a pipe)."""
    if prompt != "-":
        return prompt
    if sys.stdin is None:  # closed (`<&-`): Python leaves no stream to read
        raise ConfigError("the prompt is -, but stdin is closed: pipe the prompt in, or give it as the argument")
    if sys.stdin.isatty():  # typed at the terminal: without a word the command looked hung
        print("radiance generate: reading the prompt from stdin; end it with Ctrl-D", file=sys.stderr, flush=True)
    text = sys.stdin.read()
    if not text.strip():
        raise ConfigError("the prompt is -, but stdin holds no text")
    return text.rstrip("\n")  # the newline `echo` and editors end a file with is not part of the message


# each constraint's StructuredOutput field and the flag that sets it
_CONSTRAINT_FLAGS = {"json": "--json-schema", "json_object": "--json", "regex": "--regex", "choice": "--choice",
                     "grammar": "--grammar"}


def structured_output_from_args(args):
    """The StructuredOutput the constraint options ask for (checked: it parses), or None."""
    from radiance.engine.structured_output import StructuredOutput, check_syntax

    if args.regex == "":  # matches the empty output only: every answer would be blank
        raise ConfigError("--regex is empty: it matches only an empty output; give a pattern")
    kind = next((k for k in ("json_schema", "grammar", "json_object", "regex", "choice")
                 if getattr(args, k) not in (None, False)), None)
    if kind is None:
        return None
    kind = "json" if kind == "json_schema" else kind
    # the dataclass's messages name its fields ("choice needs ..."); the user typed flags
    with _errors_naming(_CONSTRAINT_FLAGS[kind], kind):
        if kind == "json":
            spec = StructuredOutput(json=_json_schema_text(args.json_schema))
        elif kind == "grammar":
            spec = StructuredOutput(grammar=_read(args.grammar, "--grammar"))
        else:
            spec = StructuredOutput(json_object=args.json_object, regex=args.regex, choice=args.choice)
        check_syntax(spec)
    return spec


@contextlib.contextmanager
def _errors_naming(flag: str, field: str):
    """A constraint's error names its flag: the field it begins with as the flag ("--choice needs at least one
    non-empty string"), else the flag before it ("--regex: invalid regex constraint: ...")."""
    try:
        yield
    except StructuredOutputError as exc:
        message = str(exc)
        if message.startswith(field + " "):
            message = flag + message[len(field):]
        elif not message.startswith(flag):
            message = f"{flag}: {message}"
        raise StructuredOutputError(message) from None


def _json_schema_text(value: str) -> str:
    """The schema as JSON text (given inline or as a file), parsed here: a typo is one line before the model
    loads, not after it (the engine compiles the constraint only when the request is added). A value that names
    no file is JSON text: `[1,2]` or `true` was read as a path ("cannot read [1,2]")."""
    inline = not os.path.exists(value)
    text = value if inline else _read(value, "--json-schema")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        if inline and value.lstrip()[:1] not in ("{", "[", '"'):  # a file name with a typo, most likely
            _read(value, "--json-schema")  # "cannot read X: No such file or directory"
        raise ConfigError(f"--json-schema is not valid JSON: {exc}") from None
    # a schema is an object, or a boolean: true takes any JSON value (xgrammar compiles it), false none at all
    if schema is False:
        raise ConfigError("--json-schema false: no value matches it, so no output could be generated")
    if not isinstance(schema, dict) and schema is not True:
        raise ConfigError(f"--json-schema must be a JSON object (a schema) or true, got {_json_kind(schema)}")
    return text


def _json_kind(value) -> str:
    return {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(value), "a number")


def _read(path: str, option: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{option}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:  # named neither the file nor the option
        raise ConfigError(f"{option}: {path} is not UTF-8 text") from None


def _stream(llm, prompt, params, lora_request=None) -> bool:
    """Streams the answer (with the LoRA adapter of `lora_request`, if any) to stdout; False when a constraint's
    output was cut before it was complete."""
    engine = llm.engine
    _, ids = llm._tokenize(prompt)
    # before generating, as the server's context_length_exceeded: a cut at the context looked like a stop
    check_fits_context(len(ids), engine.max_model_len, "the prompt", params.max_tokens, "--max-tokens")
    engine.add_request("cli", ids, params, lora_request=lora_request)
    printed, last = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed, last = len(out.text), out
    sys.stdout.write("\n")
    spec = params.structured_output
    if spec is not None and last is not None and last.finish_reason == "length" \
            and not _complete_under(engine, spec, last.token_ids):
        # the constraint holds every token, but only a finished output is whole (a JSON object closed, a choice
        # written out): a cut one looked like a valid answer
        logger.warning("--max-tokens %d cut the output before the constraint was complete: it is not valid; raise "
                       "--max-tokens", params.max_tokens)
        return False  # exit 1: a script reading stdout must not take it for a valid answer
    return True


def _complete_under(engine, spec, token_ids: list[int]) -> bool:
    """Whether the output `token_ids`, cut by --max-tokens, is already a whole answer under the constraint: a fresh
    matcher of it (the compile is cached) fed the tokens can end there. The constraint's own matcher, not a guess
    per kind: `root ::= "yes" | "no"` cut after "no" is whole, `{"type": "integer", "minimum": 1000}` cut after
    "1" is not, though json.loads reads it."""
    state = engine.grammar_backend().matcher(spec)
    if not all(state.accept(token) for token in token_ids):  # a token the mask refused ends the request early
        return False
    return state.matcher.is_completed()
