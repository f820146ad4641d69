"""vLLM's tokenizer routes: /tokenize, /detokenize, /tokenizer_info."""

from __future__ import annotations

from fastapi import APIRouter

from radiance.server.protocol_tokenizer import DetokenizeRequest, TokenizeRequest
from radiance.server.routes_common import State
from radiance.server.serving_chat import render_prompt
from radiance.server.serving_common import check_token_ids, encode_prompt, vocabulary_strings

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State):
    state.require_engine()
    state.check_model(body.model)
    state.require_tokenizer()
    # encode_prompt, as the completion routes: a text too long for the context by its length alone is a 400
    # before tokenizing (a 6 MB one held the whole server for 9 s)
    if body.messages is not None:  # rendered exactly as /v1/chat/completions would render it
        chat = body.chat_request()
        text = await state.off_loop(render_prompt, state, chat,
                                    with_tools=chat.renders_tools(state.config.exclude_tools_when_tool_choice_none))
        tokens = await state.off_loop(encode_prompt, state, text, "messages",
                                      add_special_tokens=bool(body.add_special_tokens))
    else:
        tokens = await state.off_loop(encode_prompt, state, body.prompt, "prompt",
                                      add_special_tokens=body.add_special_tokens is not False)
    answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        answer["token_strs"] = vocabulary_strings(state.tokenizer, tokens)
    return answer


@router.get("/tokenizer_info")
async def tokenizer_info(state: State):
    """The special tokens and chat template, as vLLM serves them: lm-evaluation-harness's remote
    tokenizer reads this, then /tokenize and /detokenize, instead of downloading the tokenizer."""
    state.require_engine()
    tok = state.require_tokenizer()
    special = {name: getattr(tok, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
    return {"tokenizer_class": type(tok).__name__, **special, "chat_template": state.chat_template,
            "model_max_length": state.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State):
    state.require_engine()
    state.check_model(body.model)
    check_token_ids(state, body.tokens, "tokens")
    return {"prompt": state.require_tokenizer("tokens").decode(body.tokens)}
