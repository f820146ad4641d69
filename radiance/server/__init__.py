"""The OpenAI-compatible HTTP server (`radiance serve`).

protocol (request models) -> api (routes, auth) -> serving_chat / serving_completions (n choices,
streaming, parsers) -> the engine (AsyncLLMEngine). errors, metrics, chat_template, tool_parsers and
reasoning_parser are the pieces they share; state holds what the routes share.
"""
