"""Render a model's chat template (a jinja2 string from tokenizer_config or GGUF metadata).

Templates run in jinja2's immutable sandbox with the helpers Hugging Face templates expect:
`raise_exception`, a `tojson` filter that keeps non-ASCII text, and `strftime_now`. Messages go in
as plain dicts; a tool call's JSON `arguments` string is handed to the template as a dict, since most
templates print it with `tojson`. gpt-oss's (harmony) template gets the messages and tools in the shape it
reads (_harmony_messages), Mistral's the 9-character call ids it insists on (mistral_call_id).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radiance.config import CONTENT_FORMATS
from radiance.errors import ConfigError
from radiance.server.tool_parsers.mistral import ID_ALPHABET, ID_LENGTH


class TemplateError(ValueError):
    """The template itself refused the messages (its raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks;
    for inference the block is its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the `generation` tag itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# where a model's templates were read from ("file DIR/chat_template.jinja"), by their text: a parse error found when
# one is first rendered names it (checkpoint readers note it; --chat-template text has none)
_SOURCES: dict[str, str] = {}


def note_source(template: str, source: str) -> None:
    """Remember that `template` was read from `source` ("file PATH[, metadata KEY]") for its parse errors."""
    _SOURCES[template] = source


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        source = _SOURCES.get(template)
        raise ConfigError(f"chat template does not parse: {exc.message} (line {exc.lineno}"
                          + (f", {source})" if source else ")")) from exc


def check_template(template: str, source: str | None = None) -> None:
    """A template that does not parse is a ConfigError naming the line, and `source` (or the one noted) where the
    template was read from (checked before a model loads, and by inspect)."""
    if source:
        note_source(template, source)
    _compile(template)


def template_errors(checkpoint) -> list[tuple[str, ConfigError]]:
    """(name, error) of each of `checkpoint`'s chat templates that does not parse, the error naming where it was read
    (inspect lists them, serve warns of them at startup)."""
    errors = []
    for name, template in checkpoint.chat_templates.items():
        try:
            check_template(template, checkpoint.template_source(template))
        except ConfigError as exc:
            errors.append((name, exc))
    return errors


def load_template(value: str | None) -> str | None:
    """`--chat-template`: a path to a file, or the template text itself."""
    if value is None:
        return None
    if "{" not in value and os.path.exists(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if "{" not in value:
        raise ConfigError(f"chat template file not found: {value}")
    return value


def _template_message(message: dict) -> dict:
    """Tool-call arguments arrive as JSON strings; templates want mappings. A null content (an assistant
    turn that only calls tools, as OpenAI clients send it back) becomes "": many templates concatenate it.
    Reasoning (`reasoning_content`, vLLM's field; `reasoning`, OpenAI's; `thinking`, gpt-oss's) fills all three."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    # reasoning sent back under any of its names reaches templates under all of them, as transformers passes it
    reasoning = next((out[key] for key in ("reasoning_content", "thinking", "reasoning") if out.get(key) is not None),
                     None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass  # leave it a string; the template decides
            call["function"] = fn
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates take only 9-character alphanumeric call ids and raise on any other (OpenAI's `call_...`,
    another server's): such an id is rendered as one derived from it, the same for a call and its reply."""
    if len(call_id) == ID_LENGTH and call_id.isascii() and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(ID_ALPHABET[byte % len(ID_ALPHABET)] for byte in digest[:ID_LENGTH])


def _mistral_call_ids(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("tool_call_id"), str):
            message["tool_call_id"] = mistral_call_id(message["tool_call_id"])
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "id": mistral_call_id(call["id"])} if isinstance(call.get("id"), str)
                                     else call for call in message["tool_calls"]]
        out.append(message)
    return out


def _harmony_tools(tools: list[dict]) -> list[dict]:
    """gpt-oss's template writes `"// " + tool.description`: a function without one gets "" (an empty line).
    Tools from chat_template_kwargs are any objects: one whose function is not an object is left to the template."""
    return [{**tool, "function": {**tool["function"], "description": tool["function"].get("description") or ""}}
            if isinstance(tool.get("function"), dict) else tool for tool in tools]


def _harmony_messages(messages: list[dict]) -> list[dict]:
    """Messages as gpt-oss's template reads them: reasoning sent back (`reasoning_content`, vLLM's field,
    `reasoning`, or `thinking` itself) as `thinking`, and one tool call per assistant message, as the template
    renders only `tool_calls[0]` (harmony has one call per message). A reply goes right after its call, since the
    template names each reply after the latest call; replies that name no call of the turn keep their place."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        i += 1
        if message.get("role") != "assistant":
            out.append(message)
            continue
        reasoning = message.get("reasoning_content") or message.get("reasoning") or message.get("thinking")
        calls = message.get("tool_calls") or []
        if reasoning and calls and message["content"] and isinstance(message["content"], str):
            # the template refuses content and thinking on a call message and renders the content (a
            # preamble) as analysis: both become the analysis, in the order the model wrote them
            message["content"], reasoning = "", reasoning + "\n\n" + message["content"]
        if reasoning:
            message["thinking"] = reasoning
        if len(calls) < 2:
            out.append(message)
            continue
        replies = []
        while i < len(messages) and messages[i]["role"] == "tool":
            replies.append(messages[i])
            i += 1
        placed: set[int] = set()
        for n, call in enumerate(calls):
            out.append({**message, "tool_calls": [call]} if n == 0 else
                       {"role": "assistant", "content": "", "tool_calls": [call]})
            for k, reply in enumerate(replies):
                if k not in placed and call.get("id") is not None and reply.get("tool_call_id") == call["id"]:
                    out.append(reply)
                    placed.add(k)
        out += [reply for k, reply in enumerate(replies) if k not in placed]
    return out


# vLLM's chat_template_content_format: a message's content as the template gets it. "string": one text (text parts
# joined by newlines); "openai": OpenAI's list of parts ([{"type": "text", "text": ...}]); "auto": "openai" for a
# template that loops over a message's content (content_format_of), else "string"
def content_format_of(template: str | None, given: str = "auto") -> str:
    """`given` ("auto", "string" or "openai") resolved for `template`: "string" or "openai". A ValueError for
    another value."""
    if given not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(map(repr, CONTENT_FORMATS))}, "
                         f"got {given!r}")
    if given != "auto":
        return given
    return "openai" if template and _loops_over_content(template) else "string"


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` is variable `name` (or its `key`: name[key], name.key), through filters, tests and slices: vLLM's
    _is_var_or_elems_access."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is not None:
        if isinstance(node, nodes.Getitem):
            return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key
    return _is_name(node, name)


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


class _NotDetected(Exception):
    """A binding vLLM's detection does not follow (a tuple target): the default, "string"."""


def _loop_targets(root: nodes.Template, names: set[str], key: str | None = None) -> set[str]:
    """The variables of the `for` loops over one of `names` (or its `key`)."""
    targets = set()
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, name, key) for name in names):
            if not isinstance(loop.target, nodes.Name):
                raise _NotDetected
            targets.add(loop.target.name)
    return targets


@functools.lru_cache(maxsize=32)
def _loops_over_content(template: str) -> bool:
    """vLLM's "auto" detection: the template loops over a message's content (`{% for part in message['content']
    %}`), the message being a loop variable over `messages` or over a variable set from it (`{% set msgs =
    messages[1:] %}`). A template that does not parse: False (vLLM's default, "string"; rendering reports it)."""
    try:
        root = _compile(template).environment.parse(template)
    except (ConfigError, jinja2.TemplateError):
        return False
    aliases, todo = {"messages"}, ["messages"]
    try:
        while todo:  # the variables set from `messages`, from those, and so on
            name = todo.pop()
            for assign in root.find_all(nodes.Assign):
                if _reads(assign.node, name):
                    if not isinstance(assign.target, nodes.Name):
                        raise _NotDetected
                    if assign.target.name not in aliases:
                        aliases.add(assign.target.name)
                        todo.append(assign.target.name)
        return bool(_loop_targets(root, _loop_targets(root, aliases), "content"))
    except _NotDetected:
        return False


def _text_parts(content: list) -> list[dict]:
    """A list content's parts, each a {"type": "text", "text": ...} dict (text only here: another part is a
    ValueError)."""
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            shown = repr(part)
            raise ValueError(f"message content parts must be {{'type': 'text', 'text': ...}} (text only), got "
                             f"{shown if len(shown) <= 60 else shown[:57] + '...'}")
    return [dict(part) for part in content]


def with_content_format(messages: list[dict], content_format: str) -> list[dict]:
    """The messages (copies) with their content as vLLM hands it to a template of `content_format` ("string" or
    "openai", content_format_of's): "string": text parts joined by newlines; "openai": a list of text parts, a
    string as one part, no content as none, but a tool message's text parts joined into one string (vLLM's: most
    templates print a tool result as a string)."""
    out = []
    for message in messages:
        content = message.get("content")
        parts = _text_parts(content) if isinstance(content, list) else None
        if content_format == "openai" and message.get("role") != "tool":
            if parts is None:
                parts = [] if content is None else [{"type": "text", "text": content}]
            message = {**message, "content": parts}
        elif parts is not None:
            message = {**message, "content": "\n".join(part["text"] for part in parts)}
        out.append(message)
    return out


def render_chat(template: str, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, **kw: Any) -> str:
    """The prompt text for `messages`. `kw` reaches the template as variables (bos_token, eos_token,
    enable_thinking, ...)."""
    compiled = _compile(template)
    messages = [_template_message(m) for m in messages]
    if "developer" not in template:  # OpenAI's developer role: the system prompt, to a template with no such role
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    # Only harmony (gpt-oss) templates get these: other templates print the tools as JSON (an invented
    # description would change the prompt), loop over all calls of a message, and read reasoning_content;
    # only Mistral's check call ids
    features = template_features(template)
    if features["harmony"]:
        messages, tools = _harmony_messages(messages), tools and _harmony_tools(tools)
    if features["mistral"]:
        messages = _mistral_call_ids(messages)
    try:
        return compiled.render(messages=messages, tools=tools or None,
                               add_generation_prompt=add_generation_prompt, **kw)
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"chat template tried an unsafe operation: {exc}") from exc
    except Exception as exc:  # the template is the model's code: whatever it raises, these messages made it fail
        raise TemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def template_features(template: str | None) -> dict:
    """What markup a template uses, to pick default parsers."""
    text = template or ""
    return {
        "qwen3_coder": "<tool_call>" in text and "<function=" in text,
        "glm45": "<tool_call>" in text and "<arg_key>" in text,
        "hermes": "<tool_call>" in text,
        # Llama 3.x and 4: calls written as {"name": ..., "parameters": ...} (and <|python_tag|> for built-in tools);
        # Llama 4's headers are <|header_start|>
        "llama3_json": "<|python_tag|>" in text or (("<|start_header_id|>" in text or "<|header_start|>" in text)
                                                   and '"parameters"' in text),
        "mistral": "[TOOL_CALLS]" in text,  # Mistral: calls after its [TOOL_CALLS] token
        "think": "<think>" in text,
        "mistral_think": "[THINK]" in text,  # Magistral: reasoning between its [THINK] and [/THINK] tokens
        "harmony": "<|channel|>" in text,  # gpt-oss: messages in channels (analysis, commentary, final)
    }


THINKING_CLOSE = "\n</think>\n\n"  # after an opened block, what Qwen3's templates write for enable_thinking=false


def close_thinking(prompt: str) -> str:
    """A prompt that leaves `<think>` open (prompt_opens_thinking), with the block closed empty: the model starts
    on its answer, as with thinking turned off. The server does so for a constraint only where no think reasoning
    parser could set the reasoning apart (with one, the constraint holds the text after </think>: serving_chat)."""
    return prompt + THINKING_CLOSE


def prompt_closes_thinking(prompt: str) -> bool:
    """True when the rendered prompt ends with a `<think>` block the template closed (Qwen3's hybrid template with
    enable_thinking=false writes `<think>\n\n</think>\n\n`, DeepSeek-V3.1's without thinking `</think>`): thinking
    is off, the model starts on its answer (vLLM: the prompt's reasoning already ended)."""
    return prompt.rstrip().endswith("</think>")


def prompt_opens_thinking(prompt: str, last_content: str = "", continuing: bool = False) -> bool:
    """True when the rendered prompt leaves a `<think>` block open (the model starts inside it). The opening
    must be the template's, after the last message (a user asking what `<think>` does opens nothing), or
    inside that message when the model continues it (continue_final_message). A last message the template
    did not render verbatim cannot be located: any unclosed `<think>` counts then."""
    start = prompt.rfind("<think>")
    if start < 0 or prompt.find("</think>", start) >= 0:
        return False
    if not last_content or prompt.rfind(last_content) < 0:
        return True
    if continuing and prompt.rfind(last_content) <= start:
        return True  # the continued message opened it (the prompt ends with that message)
    return prompt.rfind(last_content, 0, start) >= 0  # the whole last message comes before the opening


# appended to a message to be continued (continue_final_message), to find where the template wrote its end
# (transformers' tag: a template sees what it sees under transformers, and the text it writes after the message
# can never be mistaken for it)
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final_message(messages: list[dict]) -> list[dict]:
    """The messages with CONTINUE_TAG after the last one's content (copies: the caller's stay as they are); content
    as OpenAI's parts (content format "openai") gets it after its last text part, or as a part of its own."""
    last = messages[-1]
    content = last.get("content")
    if not isinstance(content, list):
        return [*messages[:-1], {**last, "content": (content or "") + CONTINUE_TAG}]
    texts = [i for i, part in enumerate(content) if isinstance(part, dict) and part.get("type") == "text"]
    if not texts:
        return [*messages[:-1], {**last, "content": [*content, {"type": "text", "text": CONTINUE_TAG}]}]
    i = texts[-1]
    tagged = {**content[i], "text": content[i]["text"] + CONTINUE_TAG}
    return [*messages[:-1], {**last, "content": [*content[:i], tagged, *content[i + 1:]]}]


def final_text(message: dict) -> str:
    """The text of a message to be continued that cut_at_continue_tag looks for: its content, or the text of its
    last text part (transformers' pick for content given as parts)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return texts[-1] if texts else ""
    return content or ""


def cut_at_continue_tag(prompt: str, final: str) -> str | None:
    """The prompt rendered from tag_final_message's messages, up to where the template wrote the final message's
    end (`final`: its content); None when the template does not write that content."""
    cut = prompt.rfind(CONTINUE_TAG.strip())
    if cut < 0 or final.strip() not in prompt[:cut]:  # the tag alone could come from another message's text
        return None
    # a template that trimmed the message trimmed the tag's space too: the message's own trailing space with it
    return prompt[:cut] if prompt.startswith(CONTINUE_TAG, cut) else prompt[:cut].rstrip()
