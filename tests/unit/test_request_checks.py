"""The request checks the engine, the CLI and the server share (engine/request_checks.py): each refuses what it
should, lets the rest through, and names the offending field; the server turns them into OpenAI's 400s."""

from __future__ import annotations

import pytest

from radiance.engine.request_checks import (ContextLengthError, RequestError, SamplingParamsError,
                                            check_fits_context, check_logit_bias_value, check_not_empty,
                                            check_token_ids, check_utf8, lone_surrogate_at)
from radiance.engine.sampling_params import SamplingParams
from radiance.errors import RadianceError
from radiance.server.errors import OpenAIError
from radiance.server.serving_common import request_checked


def _refused(check, *args) -> RequestError:
    with pytest.raises(RequestError) as err:
        check(*args)
    return err.value


def test_errors_are_radiance_errors_and_value_errors():
    """The server answers a RadianceError with a 400 and the CLI prints it as one line; callers that caught the
    engine's ValueError still do."""
    for error in (RequestError, ContextLengthError, SamplingParamsError):
        assert issubclass(error, RadianceError) and issubclass(error, ValueError)


@pytest.mark.parametrize("prompt", ["", [], ()])
def test_an_empty_prompt_is_refused_by_name(prompt):
    err = _refused(check_not_empty, prompt, "prompt[2]")
    assert str(err) == "prompt[2] must not be empty" and err.field == "prompt[2]"


@pytest.mark.parametrize("prompt", ["x", [0], [[]]])
def test_a_prompt_with_something_in_it_passes(prompt):
    assert check_not_empty(prompt, "prompt") is None
    _refused(check_not_empty, prompt[:0], "prompt")  # the same kind, empty: refused


def test_a_prompt_that_fits_passes():
    """Each boundary from both sides: what fits passes, one token more is refused."""
    assert check_fits_context(5, 32, "prompt") is None  # no max_tokens: the output ends at the context
    assert check_fits_context(5, 32, "prompt", 27) is None  # exactly the room left
    _refused(check_fits_context, 5, 32, "prompt", 28)
    assert check_fits_context(31, 32, "prompt") is None
    _refused(check_fits_context, 32, 32, "prompt")


def test_a_prompt_without_tokens_is_refused():
    err = _refused(check_fits_context, 0, 32, "prompt_token_ids")
    assert str(err) == "prompt_token_ids must not be empty" and err.field == "prompt_token_ids"
    assert not isinstance(err, ContextLengthError)


@pytest.mark.parametrize("prompt_tokens", [32, 40])
def test_a_prompt_that_leaves_no_room_for_output_names_the_prompt(prompt_tokens):
    err = _refused(check_fits_context, prompt_tokens, 32, "messages", 1, "max_tokens")
    assert isinstance(err, ContextLengthError) and err.field == "messages"
    assert (err.prompt_tokens, err.context, err.max_tokens) == (prompt_tokens, 32, None)
    assert str(err) == (f"messages has {prompt_tokens} tokens; this model serves at most 32 tokens including the "
                        "output (max_model_len)")


def test_max_tokens_beyond_the_room_left_names_max_tokens_and_the_room():
    err = _refused(check_fits_context, 5, 32, "the prompt", 28, "--max-tokens")
    assert isinstance(err, ContextLengthError) and err.field == "--max-tokens"
    assert (err.prompt_tokens, err.context, err.max_tokens) == (5, 32, 28)
    assert str(err) == ("--max-tokens 28 does not fit the model's context of 32 tokens (max_model_len) after a "
                        "prompt of 5 tokens: use --max-tokens 27 or less")
    assert "a prompt of 1 token:" in str(_refused(check_fits_context, 1, 4, "prompt", 9))


def test_token_ids_inside_the_vocabulary_pass():
    assert check_token_ids([0, 5, 9], 10, "prompt") is None
    assert check_token_ids([], 10, "logit_bias") is None
    _refused(check_token_ids, [0, 5, 10], 10, "prompt")  # one past the last id


@pytest.mark.parametrize("ids, bad", [([1, 10, 3], [10]), ([-1, 2], [-1]), (list(range(20)), [10, 11, 12, 13, 14])])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(ids, bad):
    err = _refused(check_token_ids, ids, 10, "prompt[1]")
    assert str(err) == f"prompt[1] has token id(s) outside the vocabulary [0, 10): {bad}"
    assert err.field == "prompt[1]"


@pytest.mark.parametrize("bad", [2.5, True, "3", None])
def test_token_ids_that_are_not_integers_are_refused(bad):
    """2.5 passed the range check and was served as token 2."""
    err = _refused(check_token_ids, [1, bad, 3], 10, "prompt_token_ids")
    assert str(err) == f"prompt_token_ids must be integer token ids, got {bad!r}"
    assert err.field == "prompt_token_ids"


def test_utf8_text_passes_and_a_lone_surrogate_is_found():
    assert check_utf8("東京 🙂", "--system") is None
    assert lone_surrogate_at("東京 🙂") is None
    assert lone_surrogate_at("ab\udcffc") == 2 and lone_surrogate_at("\ud800") == 0


def test_text_that_is_not_utf8_is_refused_by_name():
    err = _refused(check_utf8, "hi \udcff there", "the prompt")  # how Python hands on a byte that is not UTF-8
    assert str(err) == "the prompt is not valid UTF-8 text (a byte at character 3 is not UTF-8)"
    assert err.field == "the prompt"


@pytest.mark.parametrize("bias", [-100.0, 0.0, 100.0, 2.5])
def test_logit_bias_values_in_range_pass(bias):
    assert check_logit_bias_value(5, bias) is None
    assert SamplingParams(logit_bias={5: bias}).logit_bias == ((5, bias),)


@pytest.mark.parametrize("bias", [-100.5, 101.0, float("inf"), float("nan")])
def test_logit_bias_values_out_of_range_are_refused(bias):
    err = _refused(check_logit_bias_value, "7", bias)
    assert isinstance(err, SamplingParamsError) and err.field == "logit_bias"
    assert str(err) == f"logit_bias values must be in [-100, 100], got {bias} for token 7"
    with pytest.raises(SamplingParamsError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={7: bias})  # the engine's parameters use the same check


def _server_error(check, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as err, request_checked():
        check(*args)
    return err.value


def test_the_server_answers_a_request_error_with_a_400_naming_its_field():
    err = _server_error(check_token_ids, [99], 10, "logit_bias")
    assert (err.status, err.param, err.code) == (400, "logit_bias", None)
    assert err.message == "logit_bias has token id(s) outside the vocabulary [0, 10): [99]"


def test_the_server_words_a_context_overflow_as_openai_does():
    err = _server_error(check_fits_context, 40, 32, "prompt", 5, "max_completion_tokens")
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert err.message == ("This model's maximum context length is 32 tokens, but the prompt has 40 tokens, "
                           "which leaves no room for output.")
    err = _server_error(check_fits_context, 10, 32, "messages", 30, "max_completion_tokens")
    assert (err.status, err.param, err.code) == (400, "max_completion_tokens", "context_length_exceeded")
    assert err.message == ("This model's maximum context length is 32 tokens. However, you requested 40 tokens "
                           "(10 in the prompt, 30 for the completion). Please reduce the prompt or "
                           "max_completion_tokens.")


def test_the_server_lets_what_passes_through():
    with request_checked():
        check_fits_context(10, 32, "messages", 22, "max_tokens")
    assert _server_error(check_fits_context, 10, 32, "messages", 23, "max_tokens").param == "max_tokens"
