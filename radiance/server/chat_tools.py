"""Tool calls on the chat route: a forced call's opening at the end of the prompt, and the grammars that hold a forced
call, or the calls a model opens under tool_choice auto with strict functions, to the tools' schemas."""

from __future__ import annotations

import functools
import logging

from radiance.engine.structured_output import StructuredOutput
from radiance.engine.tool_grammars import HARMONY, strict_tools_grammar, tool_call_grammar
from radiance.server.errors import invalid
from radiance.server.protocol import ChatCompletionRequest, NamedToolChoice
from radiance.server.state import ServerState

logger = logging.getLogger(__name__)


def forced_tool_call_prefix(state: ServerState, req: ChatCompletionRequest) -> str:
    """tool_choice "required" / named: the prompt ends with the opening of a tool call (and the function
    name when one is named), so the model can only continue a call, held to the tools' schemas too
    (forced_tool_call_constraint). After a thinking block the prompt opened, or one the model may open first
    (thinking_before_answer), the model writes this opening itself, once its reasoning has ended (prepare_chat)."""
    if state.tool_parser_name is None:
        # the calls would come out as text, and a template without tool markup never shows the model its tools:
        # a 400, as vLLM answers tool choice auto without a parser (tools were ignored silently before)
        forced = req.tool_choice not in (None, "auto")
        raise invalid(f"tool_choice {'required/named' if forced else 'auto'} needs a tool-call parser; this model's "
                      "chat template has no tool markup radiance knows (start the server with --tool-call-parser, "
                      "or send tool_choice \"none\")", param="tool_choice" if forced else "tools")
    if req.tool_choice in (None, "auto", "none"):
        return ""
    markup = state.tool_call_markup
    if markup is None:
        raise invalid(f"tool_choice required/named cannot be held in this chat template's {state.tool_parser_name} "
                      "tool markup; use tool_choice auto", param="tool_choice")
    if req.tool_choice == "required":
        return markup.required_prefix
    return markup.forced_opening(req.tool_choice.function.name)


async def forced_tool_call_constraint(state: ServerState, req: ChatCompletionRequest, tools: list[dict],
                                      after_reasoning: str | None = None) -> StructuredOutput:
    """The rest of a forced tool call held to the tools' parameter schemas (so it parses and its arguments
    validate), then, with parallel calls after a "required" one, further calls held the same way.
    `after_reasoning` (structured_output.REASONING_BEFORE, "think" or "optional_think"): a <think> block the prompt
    opened, or one the model may open first, comes before the call, so the prompt does not end with the call's
    opening: the reasoning runs free up to </think>, then the whole call is held, its opening
    (forced_tool_call_prefix) included."""
    if req.structured_output() is not None:
        raise invalid("tool_choice required/named already constrains the output; drop "
                      f"{req.constraint_field()} or use tool_choice auto", param="tool_choice")
    markup = state.tool_call_markup  # forced_tool_call_prefix refused a parser without one
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    parallel = req.parallel_tool_calls and markup is not HARMONY  # harmony: <|call|> ends the generation
    with_opening = after_reasoning is not None
    return await _tools_constraint(state, lambda: tool_call_grammar(tools, markup, named, parallel, with_opening),
                                   after_reasoning=after_reasoning)


async def strict_tools_constraint(state: ServerState, req: ChatCompletionRequest, tools: list[dict],
                                  after_reasoning: str | None = None) -> StructuredOutput | None:
    """tool_choice auto with `strict` functions: calls the model opens are held to the tools (and a strict
    function's arguments to its schema); None without strict functions or a tool-call parser, or when
    response_format already constrains the answer (one constraint per request). In a <think> block the prompt
    opened, or one the model opens first (`after_reasoning`), the reasoning runs free: the calls are held from its
    end on."""
    if (state.tool_parser_name is None or req.structured_output() is not None
            or not any(t.function.strict for t in req.tools)):
        return None
    markup = state.tool_call_markup
    if markup is None or markup is HARMONY:
        # harmony's call grammar holds forced calls only (tool_grammars.HARMONY); /v1/responses marks every
        # function strict unless told otherwise, so a 400 here would refuse most tool requests: the calls are
        # parsed as usual, not held to the schema
        _warn_unconstrained_strict(state.tool_parser_name)
        return None
    return await _tools_constraint(state, lambda: strict_tools_grammar(tools, markup, req.parallel_tool_calls),
                                   after_reasoning=after_reasoning)


@functools.lru_cache(maxsize=None)
def _warn_unconstrained_strict(parser: str) -> None:
    logger.warning("strict functions with this chat template's %s tool-call markup are served without holding the "
                   "arguments to their schemas (no grammar holds its calls under tool_choice auto)", parser)


async def _tools_constraint(state: ServerState, grammar, after_reasoning: str | None = None) -> StructuredOutput:
    try:
        spec = StructuredOutput(grammar=grammar(), after_reasoning=after_reasoning)
        await state.engine.check_structured_output(spec)
    except ValueError as exc:
        raise invalid(str(exc), param="tools") from None
    return spec
