"""Malformed requests and the (status, param) each must get. Shared by the fake-engine and the live tests.

`MODEL` in a body is replaced by the served model name; `BIG` by a token count over the context.
"""

MSG = [{"role": "user", "content": "hi"}]

# (name, method, path, body (dict or raw bytes), expected status, expected param or None)
MALFORMED = [
    ("not json", "POST", "/v1/chat/completions", b"{not json", 400, None),
    ("json array", "POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("json string", "POST", "/v1/completions", b'"hello"', 400, None),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "MODEL"}, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": []}, 400, "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": "hi"}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages[0].role"),
    ("content a number", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
    ("user without content", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user"}]},
     400, "messages[0]"),
    ("unknown model", "POST", "/v1/chat/completions", {"model": "no-such-model", "messages": MSG}, 404, "model"),
    ("unknown model completions", "POST", "/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("max_tokens zero", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "max_tokens": 0},
     400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "max_tokens": -3},
     400, "max_tokens"),
    ("max_tokens a string", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "max_tokens": "5"},
     400, "max_tokens"),
    ("max_tokens too large", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "max_tokens": "BIG"},
     400, "max_tokens"),
    ("max_completion_tokens too large", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "max_completion_tokens": "BIG"}, 400, "max_completion_tokens"),
    ("temperature negative", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "temperature": -0.5},
     400, "temperature"),
    ("temperature a bool", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "temperature": True},
     400, "temperature"),
    ("top_p above one", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_p zero", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("min_p above one", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "min_p": 2}, 400, "min_p"),
    ("top_k below -1", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "top_k": -5}, 400, "top_k"),
    ("top_k beyond int64", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "top_k": 2**70},
     400, "top_k"),  # the sampler's int64 tensor overflowed in the engine loop, which stopped serving
    ("n zero", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "n": 0}, 400, "n"),
    ("n too many", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "n": 1000}, 400, "n"),
    ("logprobs over 20", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs over 20", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("empty prompt", "POST", "/v1/completions", {"model": "MODEL", "prompt": ""}, 400, "prompt"),
    ("empty token list", "POST", "/v1/completions", {"model": "MODEL", "prompt": []}, 400, "prompt"),
    ("missing prompt", "POST", "/v1/completions", {"model": "MODEL"}, 400, "prompt"),
    ("prompt a dict", "POST", "/v1/completions", {"model": "MODEL", "prompt": {"a": 1}}, 400, "prompt"),
    ("token id out of vocabulary", "POST", "/v1/completions", {"model": "MODEL", "prompt": [1, 2, 10_000_000]},
     400, "prompt"),
    ("negative token id", "POST", "/v1/completions", {"model": "MODEL", "prompt": [[1, 2], [-1]]}, 400, "prompt[1]"),
    ("chat prompt over the context", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "hello " * 600}]}, 400, "messages"),
    ("lone surrogate in a message", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages"),
    ("lone surrogate in a prompt", "POST", "/v1/completions", {"model": "MODEL", "prompt": ["ok", "\udc00"]},
     400, "prompt[1]"),
    ("lone surrogate to tokenize", "POST", "/tokenize", {"prompt": "\ud83d"}, 400, "prompt"),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("unknown tool_choice name", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool_choice a bad word", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("tool without function", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("logit_bias key not a token id", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    ("logit_bias key a superscript digit", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # isdigit() but not int()
    ("logit_bias value over 100", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "logit_bias": {"5": 150}},
     400, "logit_bias"),
    ("logit_bias token out of vocabulary", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ("frequency_penalty over 2", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("repetition_penalty zero", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "repetition_penalty": 0},
     400, "repetition_penalty"),
    ("repetition_penalty infinite", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ("temperature not a number", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "temperature": float("nan")}, 400, "temperature"),
    ("chat_template_kwargs setting messages", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),  # a second value for render_chat's own argument: a TypeError, a 500
    ("chat_template_kwargs setting messages to tokenize", "POST", "/tokenize",
     {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("tokenize no messages", "POST", "/tokenize", {"messages": []}, 400, "messages"),  # was a 500
    ("priority without priority scheduling", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "priority": 3}, 400, "priority"),  # was ignored, logged
    ("beam search", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "use_beam_search": True}, 400,
     "use_beam_search"),  # was ignored: sampled instead
    ("chat_template in a request to a server that does not trust them", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("stop with an empty string", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "stop": [""]},
     400, "stop"),
    ("response_format an unknown type", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("response_format json_schema without its schema object", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("two output constraints", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}, 400, None),
    ("structured_outputs with two constraints", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("guided_choice empty", "POST", "/v1/chat/completions", {"model": "MODEL", "messages": MSG, "guided_choice": []},
     400, "guided_choice"),
    ("regex that does not compile", "POST", "/v1/completions",
     {"model": "MODEL", "prompt": "x", "structured_outputs": {"regex": "a(("}}, 400, "structured_outputs"),
    ("forced tool call and response_format", "POST", "/v1/chat/completions",
     {"model": "MODEL", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("stream a string", "POST", "/v1/completions", {"model": "MODEL", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("detokenize out of vocabulary", "POST", "/detokenize", {"tokens": [10_000_000]}, 400, "tokens"),
    ("tokenize neither prompt nor messages", "POST", "/tokenize", {}, 400, None),
    # /v1/responses
    ("responses without input", "POST", "/v1/responses", {"model": "MODEL"}, 400, "input"),
    ("responses empty input", "POST", "/v1/responses", {"model": "MODEL", "input": []}, 400, "input"),
    ("responses function_call_output of no call", "POST", "/v1/responses",  # was served, answering nothing
     {"model": "MODEL", "input": [{"type": "message", "role": "user", "content": "x"},
                                  {"type": "function_call_output", "call_id": "call_nope", "output": "1"}]},
     400, "input"),
    ("responses conversation", "POST", "/v1/responses",  # was ignored
     {"model": "MODEL", "input": "x", "conversation": "conv_123"}, 400, "conversation"),
    ("responses unknown model", "POST", "/v1/responses", {"model": "no-such-model", "input": "x"}, 404, "model"),
    ("responses image input", "POST", "/v1/responses", {"model": "MODEL", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400, "input"),
    ("responses bad input role", "POST", "/v1/responses", {"model": "MODEL", "input": [{"role": "wizard", "content": "x"}]},
     400, "input"),
    ("responses function_call without call_id", "POST", "/v1/responses", {"model": "MODEL", "input": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input"),
    ("responses built-in tool", "POST", "/v1/responses", {"model": "MODEL", "input": "x", "tools": [{"type": "web_search"}]},
     400, "tools"),
    ("responses tool without a name", "POST", "/v1/responses", {"model": "MODEL", "input": "x",
                                                                "tools": [{"type": "function"}]}, 400, "tools"),
    ("responses tool_choice naming no tool", "POST", "/v1/responses", {"model": "MODEL", "input": "x",
     "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice"),
    ("responses unknown previous_response_id", "POST", "/v1/responses",
     {"model": "MODEL", "input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ("responses background", "POST", "/v1/responses", {"model": "MODEL", "input": "x", "background": True},
     400, "background"),
    ("responses json_schema without schema", "POST", "/v1/responses",
     {"model": "MODEL", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ("responses max_output_tokens zero", "POST", "/v1/responses", {"model": "MODEL", "input": "x", "max_output_tokens": 0},
     400, "max_output_tokens"),
    ("responses max_output_tokens too large", "POST", "/v1/responses",
     {"model": "MODEL", "input": "x", "max_output_tokens": "BIG"}, 400, "max_output_tokens"),
    ("responses input over the context", "POST", "/v1/responses", {"model": "MODEL", "input": "hello " * 600},
     400, "input"),
    ("responses chat_template_kwargs tools not a list", "POST", "/v1/responses",
     {"model": "MODEL", "input": "x", "chat_template_kwargs": {"tools": "f"}}, 400, "chat_template_kwargs"),
    ("responses unknown stored id", "GET", "/v1/responses/resp_nope", None, 404, None),
]


def body_bytes(body, model: str, big: int):
    import json
    if isinstance(body, bytes):
        return body
    text = json.dumps(body).replace('"MODEL"', json.dumps(model)).replace('"BIG"', str(big))
    return text.encode()


def check_error_shape(response, status, param):
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
