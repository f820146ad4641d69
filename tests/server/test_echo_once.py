"""Completions echo: the prompt goes out exactly once, also when the first output has no text yet."""

from types import SimpleNamespace

from radiance.server.serving_completions import CompletionChoice


class _Metrics:
    def __getattr__(self, name):  # every metric call is a no-op here
        return lambda *a, **k: None


def test_echo_is_sent_once_when_the_first_output_is_empty():
    state = SimpleNamespace(tokenizer=None, metrics=SimpleNamespace(observe=lambda *a: None))
    choice = CompletionChoice(state, 0, "PROMPT", echo=True)
    choice.timer = _Metrics()
    outputs = [SimpleNamespace(text=t, token_ids=[1] * (i + 1), logprobs=None, prompt_logprobs=None, finished=i == 2,
                               finish_reason="length")
               for i, t in enumerate(["", "ab", "abcd"])]
    sent = "".join(choice.step(out)[0] for out in outputs)
    assert sent == "PROMPTabcd"
