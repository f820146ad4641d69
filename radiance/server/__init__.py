"""The OpenAI-compatible HTTP server (`radiance serve`).

protocol / protocol_responses (request models) -> api (routes, auth) -> serving_chat / serving_completions /
serving_responses (n choices, streaming, parsers; response_store keeps stored responses) -> the engine
(AsyncLLMEngine). errors, metrics, chat_template, chat_choice (one choice's deltas), tool_parsers and
reasoning_parser are the pieces they share; state holds what the routes share.
"""
