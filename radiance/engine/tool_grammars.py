"""Grammars that hold a model's tool calls to the request's tools (xgrammar structural tags).

A chat template writes a call in one of these markups (`ToolCallMarkup`): Hermes, the call as JSON
(`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`); Qwen3-coder, the arguments as XML
parameters (`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`);
GLM-4.5, the name then key / value pairs
(`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`);
Llama 3.x, a bare JSON object (`{"name": NAME, "parameters": {...}}`); Mistral, a JSON array of calls after its
`[TOOL_CALLS]` token (`[TOOL_CALLS] [{"name": NAME, "arguments": {...}}, ...]`) or, from its v11 tokenizer on, one
`[TOOL_CALLS]NAME[ARGS]{...}` per call, in some templates with an id the model writes (`[CALL_ID]ID[ARGS]`;
`call_markup` picks the one a template writes). xgrammar turns a function's JSON
schema into the grammar of its arguments (style "qwen_xml" for the parameters, whose values follow the
schema's types, patterns and enums), so one set of builders serves every markup:
  - `tool_call_grammar`: the rest of a forced call (tool_choice "required" or named; the prompt already
    ends with the call's opening, or, after a thinking block (the prompt's or an optional one the model opens),
    the whole call with its opening;
    gpt-oss's harmony calls too, `HARMONY`), then, for "required" with parallel calls, further whole calls after the
    markup's separator, and nothing else (the answer is its calls);
  - `strict_tools_grammar`: tool_choice "auto" with `strict` functions: free text in which every call the
    model opens is whole and names one of the tools (for Llama 3.x, whose calls are the whole answer: an
    answer that opens with a held call, or text that does not open with "{").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from radiance.engine.json_schema_grammar import patched_ebnf
from radiance.engine.json_schema_rules import check_json_schemas, served_schema
from radiance.engine.structured_output import StructuredOutputError, _reason

CALL_START = "<tool_call>"
MAX_WHITESPACE = 2  # consecutive whitespace characters between a call's JSON / XML parts


@dataclass(frozen=True)
class ToolCallMarkup:
    """How a chat template writes one call: its text up to the arguments (`opening`, with the name), the
    arguments' style (None: a JSON object) and the text after them."""

    name: str
    opening_format: str  # str.format with `name` (JSON-quoted when quote_name)
    closing: str
    quote_name: bool
    arguments_style: str | None
    trigger: str = CALL_START  # the text that opens a call wherever it may appear
    required_prefix: str = CALL_START + "\n"  # what a "required" call's prompt ends with
    calls_open_answer: bool = False  # calls are read only where the answer starts (else anywhere in the text)
    separator: str = "\n"  # between parallel calls, as the chat template writes them
    # the text around all of an answer's calls (Mistral's `[TOOL_CALLS] [` ... `]`), written once; a "required"
    # call's prompt ends with group_opening, then the start of the first call's opening (required_prefix)
    group_opening: str = ""
    group_closing: str = ""
    # text the model writes between the opening and the arguments, as a regex (Mistral's call id and [ARGS])
    arguments_lead: str = ""

    def __post_init__(self):
        if not self.required_prefix.startswith(self.group_opening):
            raise ValueError(f"{self.name}: a required call's prefix must start with the group's opening")

    def opening(self, function_name: str) -> str:
        name = json.dumps(function_name) if self.quote_name else function_name
        return self.opening_format.format(name=name)

    def forced_opening(self, function_name: str) -> str:
        """What a prompt that forces a call to `function_name` ends with: the group's opening and the call's."""
        return self.group_opening + self.opening(function_name)

    def arguments(self, schema: dict) -> dict:
        """The structural-tag content of a call's arguments under `schema` (whitespace between the parts
        bounded, so a model cannot loop on it; string values keep theirs)."""
        content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
        if self.arguments_style:
            content["style"] = self.arguments_style
        if self.arguments_lead:
            return {"type": "sequence", "elements": [{"type": "regex", "pattern": self.arguments_lead}, content]}
        return content


HERMES = ToolCallMarkup("hermes", CALL_START + '\n{{"name": {name}, "arguments": ', "}\n</tool_call>",
                        quote_name=True, arguments_style=None)
QWEN3_CODER = ToolCallMarkup("qwen3_coder", CALL_START + "\n<function={name}>\n", "</function>\n</tool_call>",
                             quote_name=False, arguments_style="qwen_xml")
# GLM-4.5 / 4.6: the name right after the tag, then key / value pairs (xgrammar's glm_xml: values typed by the schema,
# newlines between the parts optional, as GLM-4.7 leaves them out)
GLM45 = ToolCallMarkup("glm45", CALL_START + "{name}\n", "</tool_call>", quote_name=False, arguments_style="glm_xml",
                       required_prefix=CALL_START)
# Llama 3.x: the answer is a call only when it starts as one (its parser reads calls there alone); calls
# after the first follow it, e.g. separated by "; "
LLAMA3_JSON = ToolCallMarkup("llama3_json", '{{"name": {name}, "parameters": ', "}", quote_name=True,
                             arguments_style=None, trigger='{"name": ', required_prefix='{"name": ',
                             calls_open_answer=True, separator="; ")
# an answer the Llama 3.x parser reads as text: empty, or its first non-space character is not "{"
_TEXT_NOT_A_CALL = {"type": "regex", "pattern": r"\s*([^\s{][\s\S]*)?"}
MARKUPS = {m.name: m for m in (HERMES, QWEN3_CODER, GLM45, LLAMA3_JSON)}
# gpt-oss (harmony): a call is a commentary message to functions.NAME; its end, <|call|>, is one of the model's stop
# tokens, so a call's grammar ends with its arguments (and generation with the call: no parallel calls). Only
# forced calls use it: under "auto" gpt-oss may also write the recipient before the channel
# (`to=functions.NAME<|channel|>commentary json<|message|>`), which one opening cannot hold, so strict functions
# there stay unconstrained. Its header's markers are special tokens that the grammar names by their text.
HARMONY = ToolCallMarkup("harmony", "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "",
                         quote_name=False, arguments_style=None, trigger="<|channel|>commentary to=functions.",
                         required_prefix="<|channel|>commentary to=functions.")
FORCED_CALL_MARKUPS = {**MARKUPS, HARMONY.name: HARMONY}
# Mistral: `[TOOL_CALLS]` is a special token. Up to tokenizer v7 (Mistral-7B v0.3, Nemo, Small 3.1) an answer's calls are
# one JSON array after it, written "[TOOL_CALLS] [" or "[TOOL_CALLS][" as the template does; from v11 on (Small 3.2,
# Magistral, Devstral) each call has its own marker and its arguments follow an [ARGS] token.
MISTRAL = ToolCallMarkup("mistral", '{{"name": {name}, "arguments": ', "}", quote_name=True, arguments_style=None,
                         trigger="[TOOL_CALLS]", required_prefix="[TOOL_CALLS] [", separator=", ",
                         group_opening="[TOOL_CALLS] [", group_closing="]")
MISTRAL_COMPACT = dataclasses.replace(MISTRAL, required_prefix="[TOOL_CALLS][", group_opening="[TOOL_CALLS][")
MISTRAL_ARGS = ToolCallMarkup("mistral", "[TOOL_CALLS]{name}[ARGS]", "", quote_name=False, arguments_style=None,
                              trigger="[TOOL_CALLS]", required_prefix="[TOOL_CALLS]", separator="")
# templates whose calls carry an id the model writes (`[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`): the grammar holds
# it to the 9 alphanumerics Mistral's templates check
MISTRAL_CALL_ID = dataclasses.replace(MISTRAL_ARGS, opening_format="[TOOL_CALLS]{name}[CALL_ID]",
                                      arguments_lead=r"[A-Za-z0-9]{9}\[ARGS\]")


def call_markup(parser: str | None, template: str) -> ToolCallMarkup | None:
    """The markup `parser`'s calls take in a chat template's text (None: no grammar can write them). Mistral's
    templates differ by tokenizer version: an array of calls, one [ARGS] per call, or that with a call id the model
    writes ([CALL_ID])."""
    if parser != MISTRAL.name:
        return FORCED_CALL_MARKUPS.get(parser)
    if "[CALL_ID]" in template:
        return MISTRAL_CALL_ID
    if "[ARGS]" in template:
        return MISTRAL_ARGS
    return MISTRAL_COMPACT if "[TOOL_CALLS][" in template else MISTRAL


def _parameters(fn: dict) -> dict:
    """A function's parameters as the grammar serves them (json_schema_rules.served_schema for tools)."""
    return served_schema(fn.get("parameters") or {"type": "object"}, for_tools=True)


def _check_size(fns: list[dict], what: str) -> None:
    """Schemas xgrammar would take long to compile are refused (20,000 enum values: 19 s on the server's compile
    thread, which other structured requests wait for). Keywords it does not enforce are let through, as tools'
    schemas are written for models, not grammars, except in a `strict` function's, which promise the arguments
    follow them (OpenAI refuses what its strict mode cannot hold, too)."""
    check_json_schemas({f"#{i}": _parameters(fn) for i, fn in enumerate(fns) if not fn.get("strict")}, what,
                       keywords=False)
    check_json_schemas({f"functions[{fn['name']!r}].parameters#": fn.get("parameters") or {"type": "object"}
                        for fn in fns if fn.get("strict")}, what)


def _compile(tag_format: dict, what: str) -> str:
    """The EBNF of a structural tag, as it must be read back (json_schema_grammar.patched_ebnf)."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag_format}))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(f"{what} are not a usable JSON schema: {_reason(exc)}") from exc
    return patched_ebnf(str(grammar))


def _call_tag(markup: ToolCallMarkup, fn: dict, schema: dict, skip: str = "") -> dict:
    """One whole call to `fn`, its opening without the `skip` the prompt already holds."""
    opening = markup.opening(fn["name"])
    return {"type": "tag", "begin": opening[len(skip):], "content": markup.arguments(schema), "end": markup.closing}


def _call_tags(tools: list[dict], markup: ToolCallMarkup, strict_only: bool) -> list[dict]:
    """A whole call to each of `tools`, its arguments held to the function's parameters (any object for a
    non-strict function when `strict_only`)."""
    tags = []
    for fn in (t["function"] for t in tools):
        schema = _parameters(fn) if fn.get("strict") or not strict_only else {"type": "object"}
        tags.append(_call_tag(markup, fn, schema))
    return tags


def _triggered_calls(tools: list[dict], markup: ToolCallMarkup, strict_only: bool, stop_after_first: bool) -> dict:
    """Free text in which every call the model opens is a whole call to one of `tools` (_call_tags); where calls
    come in a group (Mistral's array), every group it opens holds one or more of them."""
    tags = _call_tags(tools, markup, strict_only)
    if markup.group_opening:
        tags = [{"type": "tag", "begin": markup.group_opening, "end": markup.group_closing,
                 "content": {"type": "tags_with_separator", "tags": tags, "separator": markup.separator,
                             "at_least_one": True, "stop_after_first": stop_after_first}}]
    return {"type": "triggered_tags", "triggers": [markup.trigger], "tags": tags,
            "at_least_one": False, "stop_after_first": stop_after_first}


def tool_call_grammar(tools: list[dict], markup: ToolCallMarkup, name: str | None = None,
                      parallel: bool = False, with_opening: bool = False) -> str:
    """The grammar of what a model writes after the forced opening of a call (serving_chat): for a named
    function (the prompt ends with markup.forced_opening(name)) its arguments and the call's end; otherwise (the
    prompt ends with markup.required_prefix) one whole call to any of `tools` (OpenAI function dicts), then,
    when `parallel`, any number of further whole calls, each after markup.separator, and the group's closing.
    Nothing may follow the calls: "required" makes the answer its calls, so the model ends there (or opens another).
    `with_opening`: the prompt does not end with that opening (a thinking block it opened, or one the model may
    open first, comes before the call), so the grammar starts with it: the same call, the opening included."""
    fns = [t["function"] for t in tools]
    _check_size(fns if name is None else [fn for fn in fns if fn["name"] == name], "a tool's parameters")
    if name is not None:
        fn = next(fn for fn in fns if fn["name"] == name)
        call = {"type": "sequence", "elements": [markup.arguments(_parameters(fn)), _const(markup.closing +
                                                                                          markup.group_closing)]}
        if with_opening:
            call["elements"].insert(0, _const(markup.forced_opening(name)))
        return _compile(call, "a tool's parameters")
    # the prompt ends with required_prefix (the group's opening, then the start of the first call's), or with none
    lead = markup.group_opening if with_opening else ""
    skip = "" if with_opening else markup.required_prefix[len(markup.group_opening):]
    elements = [{"type": "or", "elements": [_call_tag(markup, fn, _parameters(fn), skip=skip) for fn in fns]}]
    if lead:
        elements.insert(0, _const(lead))
    if parallel:
        another = {"type": "sequence", "elements": [_const(markup.separator),
                                                    {"type": "or", "elements": _call_tags(tools, markup, False)}]}
        elements.append({"type": "star", "content": another})
    if markup.group_closing:
        elements.append(_const(markup.group_closing))
    if parallel:  # a model may end its last call with a newline before it stops: that is no call to force
        elements.append({"type": "regex", "pattern": r"\s{0,2}"})
    call = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return _compile(call, "a tool's parameters")


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def strict_tools_grammar(tools: list[dict], markup: ToolCallMarkup, parallel: bool) -> str:
    """tool_choice auto with `strict` functions (OpenAI: arguments guaranteed to follow the schema): the
    model writes freely, but a call it opens is whole and names one of the tools, a strict function's
    arguments follow its schema, and without `parallel` the answer ends after the first call. Where calls
    only open the answer (Llama 3.x), the answer is either such a call (then, with `parallel`, text in which
    further calls are held) or text that does not open with "{"."""
    _check_size([t["function"] for t in tools if t["function"].get("strict")], "the tools' parameters")
    if not markup.calls_open_answer:
        return _compile(_triggered_calls(tools, markup, strict_only=True, stop_after_first=not parallel),
                        "the tools' parameters")
    first = {"type": "or", "elements": _call_tags(tools, markup, strict_only=True)}
    if parallel:
        first = {"type": "sequence", "elements": [first, _triggered_calls(tools, markup, strict_only=True,
                                                                            stop_after_first=False)]}
    return _compile({"type": "or", "elements": [first, _TEXT_NOT_A_CALL]}, "the tools' parameters")
