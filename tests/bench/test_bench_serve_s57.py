"""`radiance bench serve` with vLLM's `--dataset-name custom` (vllm/benchmarks/datasets CustomDataset),
`--save-detailed` (the per-request lists of vllm/benchmarks/serve.py's result) and `--backend`, end to end against
radiance's own server in front of the scripted engine (tests/server/fake_engine.py: byte tokens, its chat template
`<s><|user|>...<|end|><|assistant|>`, the reply is the text after SAY:, FAIL in it fails the stream)."""

from __future__ import annotations

import json
import logging
import random

import pytest

from radiance.bench.serve_custom import load_custom_dataset
from radiance.cli import main
from tests.server.fake_engine import FakeEngine, serve_engine

DROPPED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve_engine(engine) as url:
        yield url, engine


def _jsonl(tmp_path, rows, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _bench(server, tmp_path, *argv) -> tuple[int, dict | None, list]:
    """Runs a vLLM line against the server: (exit code, the saved result, the engine's requests it made)."""
    url, engine = server
    before = len(engine.requests)
    rc = main(["bench", "serve", "--base-url", url, "--model", "fake", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "r.json", *argv])
    saved = tmp_path / "r.json"
    return rc, json.loads(saved.read_text()) if saved.exists() else None, engine.requests[before:]


def _sent(engine, requests) -> list[str]:
    return [engine.tokenizer.decode(ids) for _, ids, _ in requests]


def _shuffled_as_vllm(rows: list) -> list:
    """vLLM's CustomDataset.load_data: random.seed(self.random_seed) (0: get_samples passes no seed), then
    random.shuffle."""
    rows = list(rows)
    random.seed(0)
    random.shuffle(rows)
    return rows


def test_a_custom_dataset_is_shuffled_templated_and_saved_with_the_per_request_lists(server, tmp_path):
    prompts = ["SAY:ab", "SAY:cde", "SAY:FAILxyz", "SAY:f", "SAY:gh"]
    path = _jsonl(tmp_path, [{"prompt": p, "other": i} for i, p in enumerate(prompts)])
    rc, saved, requests = _bench(server, tmp_path, "--backend", "vllm", "--dataset-name", "custom",
                                 "--dataset-path", path, "--num-prompts", "5", "--max-concurrency", "1",
                                 "--custom-output-len", "5", "--seed", "7", "--save-detailed")
    assert rc == 0
    order = _shuffled_as_vllm(prompts)  # vLLM's seed 0, whatever --seed says
    assert order != prompts  # the test means something: the shuffle moves them
    # each prompt in the server's chat template, rendered on the client, sent to /v1/completions as text
    assert _sent(server[1], requests) == [f"<s><|user|>{p}<|end|><|assistant|>" for p in order]
    assert {params.max_tokens for _, _, params in requests} == {5}  # --custom-output-len
    assert (saved["backend"], saved["endpoint_type"], saved["completed"], saved["failed"]) == ("vllm", "vllm", 4, 1)
    failed = order.index("SAY:FAILxyz")
    for key in (*DROPPED, "latencies", "queue_times"):
        assert len(saved[key]) == 5, key
    replies = [p.removeprefix("SAY:") for p in order]
    assert saved["generated_texts"] == ["" if i == failed else r for i, r in enumerate(replies)]
    assert saved["output_lens"] == [0 if i == failed else len(r) for i, r in enumerate(replies)]
    # the server's usage: the templated text's bytes and its BOS, as the server counted them
    assert saved["input_lens"] == [len(f"<s><|user|>{p}<|end|><|assistant|>") + 1 for p in order]
    assert [bool(e) for e in saved["errors"]] == [i == failed for i in range(5)]
    assert saved["ttfts"][failed] == 0.0 and saved["itls"][failed] == [] and saved["latencies"][failed] == 0.0
    ok = [i for i in range(5) if i != failed]
    assert all(0 < saved["ttfts"][i] <= saved["latencies"][i] for i in ok)
    assert saved["start_times"] == sorted(saved["start_times"])  # in the order sent, one at a time
    assert all(q >= 0 for q in saved["queue_times"])
    assert "generated_texts" not in saved["levels"][0]["vllm"]  # written once, at the top as in vLLM's file


def test_skip_chat_template_output_tokens_and_the_lists_vllm_drops_without_save_detailed(server, tmp_path):
    rows = [{"prompt": "SAY:abcdef", "output_tokens": 2}, {"prompt": "SAY:xyz", "output_tokens": "3"},
            {"prompt": "SAY:q", "output_tokens": 4}]
    path = _jsonl(tmp_path, rows)
    rc, saved, requests = _bench(server, tmp_path, "--dataset-name", "custom", "--dataset-path", path,
                                 "--num-prompts", "3", "--max-concurrency", "1", "--custom-output-len", "-1",
                                 "--skip-chat-template", "--disable-shuffle")
    assert rc == 0
    assert _sent(server[1], requests) == [r["prompt"] for r in rows]  # as written, in the file's order
    assert [params.max_tokens for _, _, params in requests] == [2, 3, 4]  # each line's output_tokens
    assert saved["total_output_tokens"] == 2 + 3 + 1  # "abcdef" cut at 2, "xyz" whole, "q" whole
    assert saved["backend"] == "openai"  # vLLM's default backend
    assert not set(DROPPED) & saved.keys()  # vLLM's main deletes these without --save-detailed ...
    assert len(saved["latencies"]) == len(saved["queue_times"]) == 3  # ... and keeps these


def test_openai_chat_sends_chat_requests_and_warns_that_the_template_is_applied_twice(server, tmp_path, caplog):
    path = _jsonl(tmp_path, [{"prompt": "SAY:hi"}])
    with caplog.at_level(logging.WARNING, logger="radiance.bench.serve_bench"):
        rc, saved, requests = _bench(server, tmp_path, "--backend", "openai-chat", "--endpoint",
                                     "/v1/chat/completions", "--dataset-name", "custom", "--dataset-path", path,
                                     "--num-prompts", "1")
    assert rc == 0 and saved["backend"] == "openai-chat" and saved["completed"] == 1
    # vLLM's client-side template, then the chat route's own around it
    assert _sent(server[1], requests) == ["<s><|user|><s><|user|>SAY:hi<|end|><|assistant|><|end|><|assistant|>"]
    assert "again by the server's chat route" in caplog.text


def test_radiance_s_line_keeps_the_lists_per_level_with_save_detailed_and_json(server, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("SAY:a\nSAY:b\nSAY:c\nSAY:d\n")
    argv = ["bench", "serve", "--url", server[0], "--model", "fake", "--concurrency", "1,2", "--num-prompts", "2",
            "--dataset", str(data), "--warmup", "0", "--no-ignore-eos", "--json"]
    assert main([*argv, "--save-detailed"]) == 0
    levels = json.loads(capsys.readouterr().out)["levels"]
    assert [lv["vllm"]["generated_texts"] for lv in levels] == [["a", "b"], ["c", "d"]]
    assert main(argv) == 0  # without it: none of vLLM's lists on radiance's own line
    assert not any(key in lv["vllm"] for lv in json.loads(capsys.readouterr().out)["levels"]
                   for key in (*DROPPED, "latencies"))


@pytest.mark.parametrize("lines, name, message", [
    (None, "missing.jsonl", "dataset file not found"),
    (['{"prompt": "a"}', '{"prompt": "b"', ""], "p.jsonl", "line 2: not JSON"),
    (['{"prompt": "a"}', "", '{"text": "b"}'], "p.jsonl", "line 3: no \"prompt\" field"),
    (['{"prompt": 3}'], "p.jsonl", "\"prompt\" must be a non-empty string"),
    (['["a"]'], "p.jsonl", "line 1: expected a JSON object"),
    (['{"prompt": "a"}'], "p.json", "reads a JSONL file"),
])
def test_a_bad_custom_file_is_a_clear_error_before_any_request(tmp_path, capsys, lines, name, message):
    path = tmp_path / name
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset-name", "custom", "--dataset-path",
               str(path), "--disable-tqdm"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_output_tokens_are_needed_and_checked_with_custom_output_len_minus_one(tmp_path):
    from radiance.errors import ConfigError

    path = _jsonl(tmp_path, [{"prompt": "a", "output_tokens": 3}, {"prompt": "b"}])
    with pytest.raises(ConfigError, match="line 2: no \"output_tokens\" field"):
        load_custom_dataset(path, -1)
    assert [s.output_len for s in load_custom_dataset(path, 9, shuffle=False)] == [9, 9]  # a fixed length: unread
    with pytest.raises(ConfigError, match="positive integer, got 'x'"):
        load_custom_dataset(_jsonl(tmp_path, [{"prompt": "a", "output_tokens": "x"}], "x.jsonl"), -1)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "openai-chat"], "give --endpoint /v1/chat/completions"),  # vLLM's default endpoint refuses it
    (["--backend", "openai-chat", "--endpoint", "completions"], "give --endpoint /v1/chat/completions"),
    (["--backend", "vllm", "--endpoint", "chat"], "--backend vllm sends completions requests"),
    (["--backend", "openai-audio"], "sends /v1/audio/transcriptions requests, which radiance does not serve; "
                                    "radiance drives openai, vllm, openai-chat"),
    (["--backend", "tgi"], "not one of vLLM's backends; radiance drives openai, vllm, openai-chat"),
    (["--skip-chat-template"], "--skip-chat-template is the custom dataset's"),
    (["--custom-output-len", "8", "--dataset-name", "random"], "--custom-output-len is the custom dataset's"),
    (["--save-detailed", "--max-concurrency", "2"], "--save-detailed keeps the per-request lists"),
])
def test_backend_and_flag_misuse_are_errors_naming_the_fix(argv, message, capsys):
    assert main(["bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_new_flags_help_says_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("vLLM's backends, custom dataset and detailed results:"):]  # the usage line names them too
    flags = ("--backend", "--custom-output-len", "--skip-chat-template", "--save-detailed")
    starts = [text.index(flag + " ") for flag in flags] + [len(text)]
    for flag, start, end in zip(flags, starts, starts[1:]):
        assert "(default: " in text[start:end], flag


def test_without_the_server_s_tokenize_the_template_is_an_error_and_skipping_it_a_warning(caplog):
    import asyncio

    import httpx

    from radiance.bench.serve_custom import prepare_custom_prompts
    from radiance.bench.serve_prompts import PromptSpec
    from radiance.errors import ConfigError

    specs = [PromptSpec("a b", 4), PromptSpec("c", 5)]

    def prepare(chat_template: bool):
        transport = httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": "Not Found"}))
        async def run():
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await prepare_custom_prompts(client, "m", specs, chat_template)
        return asyncio.run(run())

    with pytest.raises(ConfigError, match=r"/tokenize answered HTTP 404.*pass --skip-chat-template"):
        prepare(True)
    with caplog.at_level(logging.WARNING, logger="radiance.bench.serve_custom"):
        assert prepare(False) == specs  # sent as written, their input lengths the server's usage
    assert "input lengths are the server's usage only" in caplog.text
