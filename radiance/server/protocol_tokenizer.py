"""Request models of the tokenizer routes (/tokenize, /detokenize: vLLM's), beside the OpenAI ones of protocol.py
whose chat fields /tokenize renders with."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from radiance.server.protocol import ChatCompletionRequest, TemplateKwargs, tools_not_empty
from radiance.server.protocol_messages import ChatMessage, Tool, ToolChoice, _Model


class TokenizeRequest(_Model):
    """A prompt, or chat messages with the chat request's fields that change how they render (vLLM's
    /tokenize takes the same), so the count is the prompt_tokens a chat completion would report."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # [] was a 500 (the chat request refused it)
    # the tokenizer's special tokens (BOS) around the text; unset: true for a prompt, false for messages (the
    # template writes its own), as vLLM's and as the chat route encodes
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: str | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    # rendered as a chat completion renders them, "none" included (in the prompt unless the server runs with
    # --exclude-tools-when-tool-choice-none); the opening of a forced call, which a chat completion appends for
    # "required" or a named function, is not counted
    tool_choice: ToolChoice = None
    return_token_strs: bool = False  # vLLM's: the tokens' vocabulary strings beside their ids

    @field_validator("tools")
    @classmethod
    def _tools_not_empty(cls, tools):  # chat's 400: built into a chat request below, [] failed there as a 500
        return tools_not_empty(tools)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        ChatCompletionRequest.check_tool_choice(self.tool_choice, self.tools)  # as chat checks it: a 400, not a 500
        return self

    def chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     chat_template=self.chat_template, tools=self.tools, tool_choice=self.tool_choice)


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]
