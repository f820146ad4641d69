"""The /v1/responses store is bounded in bytes as well as in count (soak report F3: each stored response keeps its
whole input history, so a previous_response_id chain pinned unbounded memory under the count alone): the oldest
go first until both limits hold, and one over the byte budget by itself is not kept, a follow-up naming it then
answered as for one dropped."""

import json

import pytest

from radiance.config import ConfigError, ServerConfig
from radiance.server.response_store import ResponseStore, StoredResponse, stored_bytes
from tests.server.fake_engine import FakeEngine, serve_engine
from tests.server.malformed import check_error_shape
from tests.server.test_api_fake_engine import http


def response(text: str, status: str = "completed") -> StoredResponse:
    return StoredResponse({"status": status, "output": []}, [{"role": "user", "content": text}])


def test_stored_bytes_is_the_utf8_length_of_its_json():
    stored = response("é" * 10)
    text = json.dumps([stored.body, stored.conversation, stored.input_items], ensure_ascii=False)
    assert stored_bytes(stored) == len(text.encode()) == len(text) + 10


def test_the_byte_budget_drops_the_oldest():
    size = stored_bytes(response("x" * 1000))
    store = ResponseStore(capacity=100, max_bytes=3 * size + size // 2)
    for i in range(10):
        assert store.put(f"r{i}", response("x" * 1000))
        assert store.bytes <= store.max_bytes
    assert len(store) == 3 and store.bytes == 3 * size
    assert [store.get(f"r{i}") is not None for i in range(10)] == [False] * 7 + [True] * 3


def test_the_count_still_bounds_it():
    store = ResponseStore(capacity=2, max_bytes=1 << 30)
    for i in range(5):
        store.put(f"r{i}", response("x"))
    assert len(store) == 2 and store.get("r3") is not None and store.get("r2") is None


def test_one_over_the_budget_alone_is_not_kept_and_drops_what_its_id_had():
    """A stream stores an in-progress body, then its final one under the same id: a final one too large must not
    leave the in-progress one behind (a follow-up would be told to wait for it forever)."""
    store = ResponseStore(capacity=10, max_bytes=stored_bytes(response("x" * 100)))
    store.put("old", response("x"))
    assert store.put("r", response("", status="in_progress"))
    assert not store.put("r", response("x" * 101))
    assert store.get("r") is None and store.get("old") is not None
    assert store.bytes == stored_bytes(response("x"))


def test_replacing_and_deleting_keep_the_count_of_bytes():
    store = ResponseStore(capacity=10, max_bytes=1 << 20)
    store.put("a", response("x" * 50, status="in_progress"))
    store.put("a", response("x" * 500))  # the final body in place of the in-progress one
    store.put("b", response("y"))
    assert store.bytes == stored_bytes(response("x" * 500)) + stored_bytes(response("y"))
    assert store.delete("a") and not store.delete("a")
    assert store.bytes == stored_bytes(response("y")) and len(store) == 1


@pytest.mark.parametrize("capacity,max_bytes", [(0, 1 << 20), (10, 0)])
def test_a_zero_limit_keeps_nothing(capacity, max_bytes):
    store = ResponseStore(capacity, max_bytes)
    assert not store.enabled and not store.put("r", response("x")) and store.get("r") is None


def test_the_limits_as_errors_tell_them():
    assert ResponseStore(1000, 256 << 20).limits() == "the last 1000 responses within 256 MiB"
    assert ResponseStore(5, 20_000).limits() == "the last 5 responses within 20000 bytes"


def test_the_config_has_the_byte_budget():
    assert ServerConfig().responses_store_bytes == 256 << 20
    with pytest.raises(ConfigError, match="responses_store_bytes"):
        ServerConfig(responses_store_bytes=-1)


BUDGET = 20_000  # a short response takes ~1.1 kB; "SAY:" + 2000 characters ~9 kB (its text held four times)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(max_model_len=32768)
    with serve_engine(engine, responses_store=100, responses_store_bytes=BUDGET) as url:
        yield url, engine


def _respond(server, **fields):
    r = http(server, "POST", "/v1/responses", {"model": "fake", **fields}, key=None)
    assert r.status_code == 200, r.text
    return r.json()


def _kept(server, response_id: str) -> bool:
    return http(server, "GET", f"/v1/responses/{response_id}", key=None).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_over_the_budget_is_not_kept_and_a_follow_up_is_told_so(server, stream):
    if stream:
        r = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:" + "x" * 8000, "stream": True},
                 key=None)
        assert r.status_code == 200
        big = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
    else:
        big = _respond(server, input="SAY:" + "x" * 8000)["id"]
    check_error_shape(http(server, "GET", f"/v1/responses/{big}", key=None), 404, "response_id")
    r = http(server, "POST", "/v1/responses", {"model": "fake", "input": "SAY:hi", "previous_response_id": big},
             key=None)
    check_error_shape(r, 400, "previous_response_id")
    error = r.json()["error"]
    assert error["code"] == "previous_response_not_found"  # as for a response dropped or never stored
    assert "the last 100 responses within 20000 bytes" in error["message"]


@pytest.fixture
def fresh_server():
    """A server whose store starts empty (the byte sums below leave no room for other tests' responses)."""
    with serve_engine(FakeEngine(max_model_len=32768), responses_store=100, responses_store_bytes=BUDGET) as url:
        yield url, None


def test_a_chain_counts_its_history_once_and_goes_whole(fresh_server):
    first = _respond(fresh_server, input="SAY:" + "a" * 2000)["id"]
    second = _respond(fresh_server, input="SAY:" + "b" * 2000, previous_response_id=first)["id"]
    third = _respond(fresh_server, input="SAY:c", previous_response_id=second)
    assert third["output"][0]["content"][0]["text"] == "c"
    # ~9 kB, then ~8 and ~1 kB more: each link is charged what it adds (charged its whole history, ~9 + 17 + 18
    # kB, the first two would have been dropped)
    assert all(_kept(fresh_server, i) for i in (first, second, third["id"]))
    other = _respond(fresh_server, input="SAY:" + "d" * 2000)["id"]
    # the chain's last link alone holds its ~18 kB of history: beside ~9 kB more, none of the chain fits
    assert _kept(fresh_server, other) and not any(_kept(fresh_server, i) for i in (first, second, third["id"]))


def test_a_follow_up_is_charged_what_it_adds_until_its_predecessor_goes():
    store = ResponseStore(capacity=10, max_bytes=1 << 20)
    a = response("x" * 1000)
    b = StoredResponse({"status": "completed", "output": []}, a.conversation + [{"role": "user", "content": "y"}])
    store.put("a", a)
    store.put("b", b, previous_id="a")
    assert store.bytes == stored_bytes(b)  # a, then what b adds to it
    assert store.delete("a") and store.get("b") is b
    assert store.bytes == stored_bytes(b)  # b holds the history alone now: charged all of it
    store.put("c", response("z"), previous_id="a")  # a predecessor not kept: charged whole
    assert store.bytes == stored_bytes(b) + stored_bytes(response("z"))
    store.put("d", response("w"), previous_id="b")
    store.delete("d")
    assert store.bytes == stored_bytes(b) + stored_bytes(response("z")) and store.delete("b")
    assert store.bytes == stored_bytes(response("z"))


def _json_length(stored: StoredResponse) -> int:
    text = json.dumps([stored.body, stored.conversation, stored.input_items], ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "surrogatepass"))


def test_a_follow_up_measures_only_what_it_adds_and_gets_the_whole_length(monkeypatch):
    """A chain's history is measured once, where it was added: encoding a 128 MB history again for every link held
    the event loop ~1 s a link. The sizes reused are exact: the total is still json.dumps' length."""
    from radiance.server import response_store

    a = StoredResponse({"status": "completed", "output": [{"type": "message", "text": "é🙂" * 50}]},
                       [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "\ud800 ok"}],
                       [{"id": "i1", "content": "x" * 5000}])
    assert stored_bytes(a) == _json_length(a)
    encoded = []
    dumps = json.dumps
    monkeypatch.setattr(response_store.json, "dumps", lambda value, **kw: encoded.append(value) or dumps(value, **kw))
    new_message = {"role": "user", "content": "and then?"}
    b = StoredResponse({"status": "completed", "output": []}, a.conversation + [new_message],
                       a.input_items + a.body["output"] + [{"id": "i2", "content": "and then?"}])
    store = ResponseStore(capacity=10, max_bytes=1 << 20)
    store.put("a", a)
    encoded.clear()
    store.put("b", b, previous_id="a")
    assert store.get("b") is b and store.bytes == _json_length(b)  # a's length plus what b adds, exactly
    assert not any(item is a.conversation[0] or item is a.input_items[0] for item in encoded)  # reused
    assert any(item is new_message for item in encoded)
    # without the predecessor (or with one that is not its history) everything is measured
    assert stored_bytes(b) == _json_length(b)
    other = response("unrelated")
    stored_bytes(other)
    assert stored_bytes(b, other) == _json_length(b)
