"""LoRA adapters served as models, as vLLM's OpenAI server serves them: a request's `model` naming an adapter runs
on it (chat, completions, responses, /invocations; /tokenize and /detokenize take the name), /v1/models lists each
adapter (root its path, parent the base's served name), and with --allow-runtime-lora-updating
/v1/load_lora_adapter and /v1/unload_lora_adapter add and take them at runtime (vLLM's bodies, answers and status
codes). First on a scripted engine (fast: routing, errors, ids), then on the real engine with a PEFT adapter the
test writes (the output is the offline engine's with that adapter). Also two chat leftovers: a message's
`refusal: null`, and the 400 of a malformed named tool_choice."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from radiance.config import ServerConfig
from radiance.lora import LoRARequest
from radiance.server import api
from radiance.server.state import ServerState
from tests.server.fake_engine import FakeEngine, serve_in_thread
from tests.server.malformed import check_error_shape
from tests.server import test_server_churn

BASE = "fake"
CHAT = [{"role": "user", "content": "SAY:hello"}]


class FakeLoraEngine(FakeEngine):
    """The scripted engine with the LoRA interface: an adapter directory is one with adapter_config.json; a
    request records the adapter it ran with, and an adapter's reply is prefixed with its name."""

    lora_enabled = True

    def __init__(self, preloaded: tuple[LoRARequest, ...] = ()):
        super().__init__()
        self.loras = {lora.lora_int_id: lora for lora in preloaded}
        self.ran_with: list[LoRARequest | None] = []
        self.max_lora: int | None = None  # set: the stats carry vLLM's lora_requests_info fields

    def list_loras(self):
        return list(self.loras.values())

    async def add_lora(self, lora):
        if not os.path.isfile(os.path.join(lora.lora_path, "adapter_config.json")):
            raise ValueError(f"{lora.lora_path} has no adapter_config.json")
        added = lora.lora_int_id not in self.loras
        self.loras[lora.lora_int_id] = lora
        return added

    async def remove_lora(self, lora_int_id):
        return self.loras.pop(lora_int_id, None) is not None

    async def generate(self, request_id, prompt_token_ids, params, lora_request=None):
        if lora_request is not None and lora_request.lora_int_id not in self.loras:  # as AsyncLLMEngine resolves it
            if not lora_request.lora_path:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}) is not "
                                 "loaded, and the request gives no lora_path to load it from")
            await self.add_lora(lora_request)
        self.ran_with.append(lora_request and self.loras[lora_request.lora_int_id])
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out

    def stats(self):
        stats = super().stats()
        if self.max_lora is not None:
            stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters = self.max_lora, {"a": 2}, {}
        return stats


def adapter_dir(tmp_path, name: str) -> str:
    """A directory the fake engine takes as an adapter."""
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def lora_app(engine, **server_config):
    state = ServerState(ServerConfig(served_model_name=(BASE,), **server_config), engine_factory=lambda: engine)
    state.attach(engine)
    return api.build_app(state)


@pytest.fixture
def preloaded(tmp_path):
    """A server whose engine loaded two adapters at start (--lora-modules: ids 1 and 2), runtime updating on."""
    loras = (LoRARequest("sql", 1, adapter_dir(tmp_path, "sql")), LoRARequest("tone", 2, adapter_dir(tmp_path, "tone")))
    engine = FakeLoraEngine(loras)
    with TestClient(lora_app(engine, allow_runtime_lora_updating=True)) as client:
        client.engine = engine
        yield client


def models(client) -> list[dict]:
    r = client.get("/v1/models")
    assert r.status_code == 200
    return r.json()["data"]


def test_adapters_are_listed_as_models_with_vllm_cards(preloaded):
    cards = models(preloaded)
    assert [c["id"] for c in cards] == [BASE, "sql", "tone"]
    base, sql, _ = cards
    assert base["parent"] is None
    assert sql["root"] == preloaded.engine.loras[1].lora_path and sql["parent"] == BASE
    assert sql["object"] == "model" and sql["permission"][0]["object"] == "model_permission"
    assert preloaded.get("/v1/models/sql").json() == sql


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "SAY:hello"}),
    ("/v1/responses", {"input": "SAY:hello"}),
    ("/invocations", {"messages": CHAT}),
])
def test_a_request_naming_an_adapter_runs_on_it(preloaded, route, body):
    engine = preloaded.engine
    for model, expected in ((BASE, None), ("tone", engine.loras[2]), ("sql", engine.loras[1])):
        r = preloaded.post(route, json={"model": model, **body})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model  # the answer names the adapter, as vLLM's does
        assert engine.ran_with[-1] == expected


def test_every_choice_and_a_stream_run_on_the_adapter(preloaded):
    engine = preloaded.engine
    r = preloaded.post("/v1/completions", json={"model": "sql", "prompt": ["SAY:a", "SAY:b"], "n": 2, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert engine.ran_with[-4:] == [engine.loras[1]] * 4


def test_tokenizer_routes_take_an_adapter_name(preloaded):
    assert preloaded.post("/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200
    assert preloaded.post("/detokenize", json={"model": "tone", "tokens": [104, 105]}).json()["prompt"] == "hi"


def test_an_unknown_model_is_404_naming_the_adapters_too(preloaded):
    r = preloaded.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT})
    check_error_shape(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["message"].endswith("Served: fake, sql, tone")
    check_error_shape(preloaded.get("/v1/models/nope"), 404, "model")


def test_load_use_and_unload_at_runtime(preloaded, tmp_path):
    engine, path = preloaded.engine, adapter_dir(tmp_path, "new")
    r = preloaded.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' added successfully."
    assert engine.loras[3] == LoRARequest("new", 3, path)  # ids continue after the preloaded ones
    assert [c["id"] for c in models(preloaded)] == [BASE, "sql", "tone", "new"]
    assert preloaded.post("/v1/completions", json={"model": "new", "prompt": "SAY:x"}).status_code == 200
    assert engine.ran_with[-1] == engine.loras[3]

    r = preloaded.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' removed successfully."
    assert 3 not in engine.loras and [c["id"] for c in models(preloaded)] == [BASE, "sql", "tone"]
    check_error_shape(preloaded.post("/v1/completions", json={"model": "new", "prompt": "x"}), 404, "model")
    # a preloaded adapter unloads too; a later load takes a new id (never one an earlier adapter had)
    assert preloaded.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    assert preloaded.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": path}).status_code == 200
    assert sorted(engine.loras) == [2, 4]


def test_load_and_unload_errors_are_vllms(preloaded, tmp_path):
    path = adapter_dir(tmp_path, "x")
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    r = preloaded.post(load, json={"lora_name": "tone", "lora_path": path})
    check_error_shape(r, 400, "lora_name")
    assert r.json()["error"]["message"] == "The lora adapter 'tone' has already been loaded."
    r = preloaded.post(load, json={"lora_name": "", "lora_path": path})
    check_error_shape(r, 400, None)
    assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    check_error_shape(preloaded.post(load, json={"lora_name": "y"}), 400, "lora_path")
    check_error_shape(preloaded.post(load, json={"lora_name": BASE, "lora_path": path}), 400, "lora_name")
    r = preloaded.post(unload, json={"lora_name": "nope"})
    check_error_shape(r, 404, "lora_name")
    assert r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert [c["id"] for c in models(preloaded)] == [BASE, "sql", "tone"]  # nothing changed


def test_load_inplace_points_the_name_at_new_weights_under_a_new_id(preloaded, tmp_path):
    """vLLM's load_inplace: the served name's next requests run on the adapter at the new path (a new engine id),
    its card keeps its place with the new root; the replaced id stays loaded until the name's next reload (a
    request that read the name before the swap still runs) or unload; a failed reload changes nothing; on a name
    not served it is a plain load."""
    engine, load = preloaded.engine, "/v1/load_lora_adapter"
    v2, v3 = adapter_dir(tmp_path, "tone-v2"), adapter_dir(tmp_path, "tone-v3")
    r = preloaded.post(load, json={"lora_name": "tone", "lora_path": v2, "load_inplace": True})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tone' added successfully."
    assert sorted(engine.loras) == [1, 2, 3] and engine.loras[3] == LoRARequest("tone", 3, v2)
    assert [(c["id"], c["root"]) for c in models(preloaded)][1:] == [("sql", engine.loras[1].lora_path), ("tone", v2)]
    assert preloaded.post("/v1/completions", json={"model": "tone", "prompt": "SAY:x"}).status_code == 200
    assert engine.ran_with[-1] == LoRARequest("tone", 3, v2)

    not_an_adapter = tmp_path / "empty"
    not_an_adapter.mkdir()
    r = preloaded.post(load, json={"lora_name": "tone", "lora_path": str(not_an_adapter), "load_inplace": True})
    check_error_shape(r, 400, "lora_path")
    assert sorted(engine.loras) == [1, 2, 3] and models(preloaded)[2]["root"] == v2  # the reloaded one serves on

    r = preloaded.post(load, json={"lora_name": "tone", "lora_path": v3, "load_inplace": True})
    assert r.status_code == 200 and sorted(engine.loras) == [1, 3, 5]  # (id 4: the failed load's)
    assert preloaded.post("/v1/unload_lora_adapter", json={"lora_name": "tone"}).status_code == 200
    assert sorted(engine.loras) == [1]

    r = preloaded.post(load, json={"lora_name": "fresh", "lora_path": v2, "load_inplace": True})
    assert r.status_code == 200 and engine.loras[6] == LoRARequest("fresh", 6, v2)


def test_a_bad_adapter_is_a_client_error_and_the_server_serves_on(preloaded, tmp_path):
    not_an_adapter = tmp_path / "empty"
    not_an_adapter.mkdir()
    r = preloaded.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(not_an_adapter)})
    check_error_shape(r, 400, "lora_path")
    assert "has no adapter_config.json" in r.json()["error"]["message"]
    missing = str(tmp_path / "missing")
    r = preloaded.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": missing})
    check_error_shape(r, 404, "lora_path")  # vLLM's LoRAAdapterNotFoundError
    assert r.json()["error"]["message"] == (f"Loading lora bad failed: No adapter found for {missing} "
                                            f"({missing} has no adapter_config.json)")
    assert "bad" not in [c["id"] for c in models(preloaded)]
    assert preloaded.post("/v1/completions", json={"model": "tone", "prompt": "SAY:ok"}).json()["choices"][0][
        "text"] == "ok"
    path = adapter_dir(tmp_path, "good")  # the name is free: a later good load takes it
    assert preloaded.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}).status_code == 200


def test_a_request_for_an_adapter_unloaded_meanwhile_is_a_400_and_loads_nothing(preloaded):
    """The engine loads an unknown adapter from a request's lora_path: the server's requests carry none, so one for
    an adapter unloaded after its name was resolved fails instead of loading it again where no unload reaches."""
    engine = preloaded.engine
    engine.loras.pop(2)  # unloaded after the server resolved the name
    r = preloaded.post("/v1/completions", json={"model": "tone", "prompt": "SAY:x"})
    check_error_shape(r, 400, None)
    assert "is not loaded" in r.json()["error"]["message"] and 2 not in engine.loras


def test_runtime_routes_are_unknown_without_the_flag(tmp_path):
    engine = FakeLoraEngine((LoRARequest("sql", 1, adapter_dir(tmp_path, "sql")),))
    with TestClient(lora_app(engine)) as client:
        body = {"lora_name": "new", "lora_path": adapter_dir(tmp_path, "new")}
        r = client.post("/v1/load_lora_adapter", json=body)
        check_error_shape(r, 404, None)
        assert r.json()["error"]["code"] == "unknown_url"
        check_error_shape(client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 404, None)
        assert engine.loras.keys() == {1}
        # the adapters --lora-modules loaded still serve
        assert client.post("/v1/completions", json={"model": "sql", "prompt": "SAY:x"}).status_code == 200


def test_loading_without_lora_enabled_is_a_400(tmp_path):
    with TestClient(lora_app(FakeEngine(), allow_runtime_lora_updating=True)) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter_dir(tmp_path, "a")})
        check_error_shape(r, 400, None)
        assert "--enable-lora" in r.json()["error"]["message"]
        assert [c["id"] for c in models(client)] == [BASE]


def test_the_flag_is_a_serve_option():
    import argparse

    from radiance.server.cli import configs_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert not configs_from_args(parser.parse_args(["serve"]))[1].allow_runtime_lora_updating
    assert configs_from_args(parser.parse_args(["serve", "--allow-runtime-lora-updating"]))[1].allow_runtime_lora_updating


def test_metrics_carry_vllms_lora_requests_info(tmp_path):
    engine = FakeLoraEngine()
    with TestClient(lora_app(engine, metrics_prefix="vllm:")) as client:
        assert "lora_requests_info" not in client.get("/metrics").text  # the engine tells no LoRA state
        engine.max_lora = 4
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "4", "running_lora_adapters": "a", "waiting_lora_adapters": ""}
    assert sample.value > 1e9  # the time it was read, as vLLM's gauge is set to the current time


# ---------------------------------------------------------------- chat leftovers


def test_a_chat_message_carries_refusal_null():
    with TestClient(lora_app(FakeEngine())) as client:
        message = client.post("/v1/chat/completions", json={"messages": CHAT}).json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None
    assert message["content"] == "hello"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("tool_choice, fault", [
    ({"type": "function"}, "function is missing"),
    ({"type": "function", "function": {}}, "function.name is missing"),
    ({"type": "function", "function": {"name": 3}}, "function.name: Input should be a valid string"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_malformed_named_tool_choice_says_what_is_wrong_with_it(tool_choice, fault, route):
    with TestClient(lora_app(FakeEngine())) as client:
        r = client.post(route, json={"messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice})
    check_error_shape(r, 400, "tool_choice")
    message = r.json()["error"]["message"]
    assert message.endswith(fault) and '{"type": "function", "function": {"name": ...}}' in message
    assert "'none', 'auto' or 'required'" not in message


def test_a_malformed_responses_tool_choice_says_what_is_wrong_with_it():
    with TestClient(lora_app(FakeEngine())) as client:
        tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        r = client.post("/v1/responses", json={"input": "hi", "tools": tools, "tool_choice": {"type": "function"}})
    check_error_shape(r, 400, "tool_choice")
    assert r.json()["error"]["message"].endswith('{"type": "function", "name": ...}: name is missing')


# ---------------------------------------------------------------- vLLM's bench serve --lora-modules


def test_bench_serve_lora_modules_sends_each_request_to_one_of_the_adapters(tmp_path, capsys):
    from radiance.cli import main

    loras = (LoRARequest("sql", 1, adapter_dir(tmp_path, "sql")), LoRARequest("tone", 2, adapter_dir(tmp_path, "tone")))
    engine = FakeLoraEngine(loras)
    with serve_in_thread(lora_app(engine)) as url:
        rc = main(["bench", "serve", "--url", url, "--lora-modules", "sql", "tone", "--concurrency", "4",
                   "--num-prompts", "16", "--input-len", "4", "--output-len", "2", "--warmup", "1", "--no-progress"])
    assert rc == 0, capsys.readouterr()
    # the warmup on the base model (vLLM's test request), then each measured request on an adapter drawn at random
    assert engine.ran_with[0] is None and len(engine.ran_with) == 17
    assert set(engine.ran_with[1:]) == set(loras)


# ---------------------------------------------------------------- the real engine

# the tiny random Llama 3 with a byte-level BPE tokenizer (test_server_churn's): hidden 64, 4 heads of 16, 2 KV heads
REAL_SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.v_proj": (32, 64), "mlp.down_proj": (64, 128)}
PROMPT = "The quick brown fox"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
model_path = test_server_churn.model_path  # its fixture: the tiny model's directory


def write_peft_adapter(path, seed: int, rank: int = 4, alpha: float = 16.0, layers: int = 2) -> str:
    """A PEFT LoRA adapter as save_pretrained lays it out: adapter_config.json and adapter_model.safetensors with
    A [r, K] and B [N, r] of q_proj, v_proj and down_proj of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, (out, inp) in REAL_SHAPES.items():
            module = f"base_model.model.model.layers.{i}.{proj}"
            tensors[f"{module}.lora_A.weight"] = 0.3 * torch.randn(rank, inp, generator=gen)
            tensors[f"{module}.lora_B.weight"] = 0.3 * torch.randn(out, rank, generator=gen)
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "task_type": "CAUSAL_LM", "bias": "none",
              "target_modules": sorted(proj.split(".")[1] for proj in REAL_SHAPES)}
    with open(os.path.join(path, "adapter_config.json"), "w") as handle:
        json.dump(config, handle)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def real_server(model_path, tmp_path_factory):
    """The tiny model with adapter a1 loaded at start (--lora-modules) and a2 on disk, runtime updating on; the
    offline engine's greedy texts of the base and each adapter, taken on the same engine before it serves."""
    from radiance import LLM, SamplingParams
    from radiance.engine.async_engine import AsyncLLMEngine

    root = tmp_path_factory.mktemp("adapters")
    paths = {name: write_peft_adapter(root / name, seed) for name, seed in (("a1", 1), ("a2", 2))}
    llm = LLM(model_path, device="cpu", dtype="float32", enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=8, lora_modules=(f"a1={paths['a1']}",))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    offline = {"base": llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text}
    for name, lora in (("a1", LoRARequest("a1", 1, paths["a1"])), ("a2", LoRARequest("offline-a2", 9, paths["a2"]))):
        offline[name] = llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    assert llm.engine.remove_lora(9)  # the server loads a2 itself, under its own id
    async_engine = AsyncLLMEngine(engine=llm.engine)
    state = ServerState(ServerConfig(served_model_name=("base",), allow_runtime_lora_updating=True),
                        engine_factory=lambda: async_engine)
    state.attach(async_engine)
    with serve_in_thread(api.build_app(state)) as url:
        yield url, offline, paths, llm.engine


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY}, timeout=60)


def test_real_adapter_requests_give_the_offline_engines_output(real_server):
    url, offline, paths, _ = real_server
    assert offline["a1"] != offline["base"] and offline["a2"] not in (offline["base"], offline["a1"])
    for model in ("base", "a1"):
        r = complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline[model] and r.json()["model"] == model
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards][1:] == [("a1", paths["a1"], "base")]


def test_real_runtime_load_use_unload_and_bad_loads(real_server, tmp_path):
    url, offline, paths, engine = real_server
    load, unload = url + "/v1/load_lora_adapter", url + "/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "a2", "lora_path": paths["a2"]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' added successfully."
    assert [(lora.lora_name, lora.lora_int_id) for lora in engine.list_loras()] == [("a1", 1), ("a2", 2)]
    assert complete(url, "a2").json()["choices"][0]["text"] == offline["a2"]
    assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == ["base", "a1", "a2"]

    too_big = write_peft_adapter(tmp_path / "r16", seed=3, rank=16)  # past --max-lora-rank 8
    r = httpx.post(load, json={"lora_name": "big", "lora_path": too_big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert r.json()["error"]["message"].startswith("Loading lora big failed: ") and "16" in r.json()["error"]["message"]
    missing = str(tmp_path / "missing")
    r = httpx.post(load, json={"lora_name": "gone", "lora_path": missing})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"].startswith(f"Loading lora gone failed: No adapter found for {missing} (")
    assert [lora.lora_name for lora in engine.list_loras()] == ["a1", "a2"]  # nothing half-loaded

    # reloaded in place: the name's requests switch to the new weights (a1's here), and back
    for weights in ("a1", "a2"):
        r = httpx.post(load, json={"lora_name": "a2", "lora_path": paths[weights], "load_inplace": True})
        assert r.status_code == 200, r.text
        assert complete(url, "a2").json()["choices"][0]["text"] == offline[weights]
    # the id the last reload replaced stays loaded until the next reload or the unload
    assert [lora.lora_name for lora in engine.list_loras()] == ["a1", "a2", "a2"]

    r = httpx.post(unload, json={"lora_name": "a2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a2' removed successfully."
    assert [lora.lora_name for lora in engine.list_loras()] == ["a1"]
    assert complete(url, "a2").status_code == 404
    # the server serves on, adapters and base as before
    assert complete(url, "a1").json()["choices"][0]["text"] == offline["a1"]
    assert complete(url, "base").json()["choices"][0]["text"] == offline["base"]
