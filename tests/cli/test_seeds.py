"""Seeds on the command line. --seed and --sampling-seed take what a request's `seed` takes (the server's and
vLLM's OpenAI protocol: torch.long, [-2**63, 2**63 - 1]); a negative one is a seed of its own, as torch maps it
to seed + 2**64. Was: --seed 2**64 failed after the checkpoint opened with torch's "Overflow when unpacking long
long", and --sampling-seed 2**64 + 1 sampled as seed 1 (the engine wraps to 64 bits). bench serve --seed must
not be negative: Python's random takes -3 as 3, so levels (SEED + i) repeated each other's prompts."""

from __future__ import annotations

import asyncio

import pytest

from radiance.bench import serve_bench, serve_prompts
from radiance.cli import main
from radiance.config import ModelConfig


class Loading(Exception):
    """Raised where the model would load: the options passed their checks."""


@pytest.fixture
def no_loading(monkeypatch):
    from radiance.engine.llm import LLM

    def loading(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(LLM, "from_engine_config", loading)


@pytest.mark.parametrize("flag, value, name", [
    ("--seed", 2**63, "--seed"), ("--seed", -(2**63) - 1, "--seed"), ("--seed", 2**64, "--seed"),
    ("--sampling-seed", 2**63, "--sampling-seed"), ("--sampling-seed", 2**64 + 1, "--sampling-seed"),
    ("--sampling-seed", -(2**63) - 1, "--sampling-seed"),
])
def test_a_seed_beyond_64_bits_is_one_line_before_loading(no_loading, capsys, flag, value, name):
    assert main(["generate", "hi", flag, str(value)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"radiance generate: error: {name} must be a 64-bit signed integer, in [-2**63, 2**63 - 1], "
                   f"got {value}")


@pytest.mark.parametrize("flag", ["--seed", "--sampling-seed"])
@pytest.mark.parametrize("value", [-1, -(2**63), 2**63 - 1])
def test_negative_and_extreme_seeds_are_accepted(no_loading, flag, value):
    with pytest.raises(Loading):
        main(["generate", "hi", flag, str(value)])


def test_torch_takes_every_seed_the_config_accepts():
    """The range checked is one torch.manual_seed takes (the loader seeds the RNG with it)."""
    import torch

    for seed in (-(2**63), -1, 2**63 - 1):
        torch.manual_seed(ModelConfig(seed=seed).seed)
    assert torch.initial_seed() == 2**63 - 1
    torch.manual_seed(0)


def test_the_help_says_what_a_seed_may_be(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--sampling-seed SAMPLING_SEED seed of the sampler, for reproducible runs: a 64-bit signed integer" \
        in help_text
    assert "a negative one is a seed of its own (torch takes -1 as 2**64 - 1)" in help_text


def test_bench_serve_refuses_a_negative_seed(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--url", "http://127.0.0.1:9", "--seed", "-3"])
    assert info.value.code == 2
    assert "argument --seed: expected a non-negative integer, got -3" in capsys.readouterr().err


def test_the_warmup_prompts_are_no_level_s(monkeypatch):
    """Was: the warmup used seed - 1 (-1 for the default 0, which Python's random takes as 1): the second level's
    first prompts were the warmup's, already in the server's prefix cache."""
    sent = []

    async def send_request(client, opts, model, spec):
        sent.append(spec.prompt)
        return serve_bench.RequestResult(ok=True, requested_tokens=spec.output_len)

    monkeypatch.setattr(serve_bench, "send_request", send_request)
    opts = serve_bench.ServeBenchOptions(url="http://x", concurrency=(1, 2, 4), warmup=2, input_len=8, progress=False)
    asyncio.run(serve_bench.warm_up(None, opts, "m"))
    measured = {spec.prompt for i, conc in enumerate(opts.concurrency)
                for spec in serve_prompts.prompts_for_level(opts, opts.prompts_for(conc), opts.seed + i)}
    assert len(sent) == 2 and not measured & set(sent)
