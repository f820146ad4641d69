import asyncio
import json
import math

import httpx
import pytest

from radiance.bench import serve_bench, serve_prompts
from radiance.bench.serve_bench import ServeBenchOptions
from radiance.errors import ConfigError


def test_levels_against_fake_server(fake_server):
    FIRST_TOKEN_DELAY_S, TOKEN_GAP_S, MODEL = fake_server.first_token_delay_s, fake_server.token_gap_s, fake_server.model
    opts = ServeBenchOptions(url=fake_server.url, concurrency=(1, 4), num_prompts=8, input_len=12,
                             output_len=6, progress=False, warmup=0)
    result = serve_bench.run_serve_bench(opts)
    assert result["model"] == MODEL  # discovered from /v1/models
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4]
    for lv in result["levels"]:
        assert (lv["requests"], lv["ok"], lv["failed"]) == (8, 8, 0)
        assert lv["output_tokens"] == 8 * 6
        assert lv["mean_prompt_tokens"] == 12  # the prompt has input_len words
        # the server waits FIRST_TOKEN_DELAY_S before the first token and TOKEN_GAP_S between tokens
        assert FIRST_TOKEN_DELAY_S <= lv["ttft_ms"]["p50"] / 1e3 < FIRST_TOKEN_DELAY_S + 0.5
        assert TOKEN_GAP_S * 0.8 <= lv["itl_ms"]["p50"] / 1e3 < TOKEN_GAP_S + 0.2
        assert lv["e2e_s"]["p50"] >= FIRST_TOKEN_DELAY_S + 5 * TOKEN_GAP_S
        assert lv["output_tok_s"] <= 1.0 / TOKEN_GAP_S * 1.1
        assert lv["aggregate_tok_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
    serial, parallel = result["levels"]
    # the level of 4 kept 4 requests in flight at once (never more), so it finished the same work faster; the ratio is
    # bounded loosely (ideally ~4x: 1.85x was seen on a loaded 2-core machine, where 2x failed)
    assert fake_server.max_in_flight[0] == 4
    assert parallel["aggregate_tok_s"] > 1.5 * serial["aggregate_tok_s"]
    table = serve_bench.serve_table(result)
    assert "TTFT p50 ms" in table and MODEL in table


def test_failures_are_counted_and_chat_endpoint(fake_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join([json.dumps({"prompt": "hello there", "output_len": 3}),
                               json.dumps({"prompt": "please FAIL now"}),
                               "a plain text prompt"]) + "\n")
    opts = ServeBenchOptions(url=fake_server.url, model=fake_server.model, concurrency=(2,), num_prompts=6,
                             dataset=str(data), output_len=5, endpoint="chat", progress=False, warmup=0)
    lv = serve_bench.run_serve_bench(opts)["levels"][0]
    assert (lv["ok"], lv["failed"]) == (4, 2)
    assert lv["output_tokens"] == 2 * 3 + 2 * 5  # per-line output_len, else the default
    assert any("HTTP 500" in e for e in lv["errors"])


def test_request_rate_spaces_arrivals(fake_server):
    offsets = serve_bench.arrival_offsets(200, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert 0.07 < sum(gaps) / len(gaps) < 0.13  # mean gap of a Poisson process at 10/s is 0.1 s
    assert serve_bench.arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    opts = ServeBenchOptions(url=fake_server.url, model=fake_server.model, concurrency=(8,), num_prompts=4, input_len=4,
                             output_len=2, request_rate=20.0, progress=False, warmup=0)
    lv = serve_bench.run_serve_bench(opts)["levels"][0]
    assert lv["ok"] == 4
    # the last of 4 arrivals comes after 3 exponential gaps; the level cannot end before it
    last = serve_bench.arrival_offsets(4, 20.0, seed=opts.seed)[-1]
    assert lv["duration_s"] >= last


def test_unreachable_server_counts_failures():
    opts = ServeBenchOptions(url="http://127.0.0.1:9", model="x", concurrency=(2,), num_prompts=2,
                             input_len=2, output_len=2, progress=False, warmup=0, timeout_s=2)
    lv = serve_bench.run_serve_bench(opts)["levels"][0]
    assert (lv["ok"], lv["failed"]) == (0, 2)
    assert math.isnan(lv["ttft_ms"]["p50"])


def test_options_validation(tmp_path):
    with pytest.raises(ConfigError, match="concurrency levels must be positive"):
        ServeBenchOptions(url="http://x", concurrency=(0,))
    with pytest.raises(ConfigError, match="endpoint must be 'completions' or 'chat'"):
        ServeBenchOptions(url="http://x", endpoint="embeddings")
    with pytest.raises(ConfigError, match="not found"):
        serve_prompts.load_dataset(str(tmp_path / "missing.jsonl"), 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        serve_prompts.load_dataset(str(bad), 4)
    prompts = serve_prompts.random_prompts(3, 10, 4, seed=0)
    assert len({p.prompt for p in prompts}) == 3 and all(len(p.prompt.split()) == 10 for p in prompts)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi", "output_len": null}', "output_len"),
    ('{"prompt": "hi", "output_len": [3]}', "output_len"),
    ('{"prompt": "hi", "output_len": 1e400}', "output_len"),
    ('{"prompt": "hi", "output_len": 0}', "output_len"),
    ('{"prompt": "hi", "output_len": -2}', "output_len"),
    ('{"prompt": "hi", "output_len": 2.7}', "output_len"),
    ('{"prompt": "hi", "output_len": true}', "output_len"),
    ('{"prompt": null}', "prompt"),
    ('{"prompt": 12}', "prompt"),
])
def test_dataset_rows_are_checked(tmp_path, line, message):
    """A bad output_len or prompt is the file's error, named with its line, not a traceback or a bad request."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "fine", "output_len": 4}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"line 2.*{message}"):
        serve_prompts.load_dataset(str(data), 8)


def test_timeout_and_warmup_are_checked():
    for bad in ({"timeout_s": 0.0}, {"timeout_s": -1.0}, {"timeout_s": math.nan}, {"warmup": -1}):
        with pytest.raises(ConfigError, match=f"^{next(iter(bad)).removesuffix('_s')} must be"):
            ServeBenchOptions(url="http://x", **bad)


def test_a_non_object_stream_event_fails_its_request_only(fake_server):
    """A server that streams `data: [1, 2]` fails that request (counted, with its error), not the whole run."""
    opts = ServeBenchOptions(url=fake_server.url, model=fake_server.model, progress=False, warmup=0)

    async def send(*prompts):
        async with httpx.AsyncClient(base_url=fake_server.url) as client:
            return [await serve_bench.send_request(client, opts, fake_server.model, serve_prompts.PromptSpec(p, 2))
                    for p in prompts]

    ok, bad = asyncio.run(send("hello", "GARBLE me"))
    assert ok.ok and ok.output_tokens == 2
    assert not bad.ok and "stream event" in bad.error
