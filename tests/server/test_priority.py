"""vLLM's `priority`: 0 (its default) is served, any other value is a 400, as vLLM answers without priority
scheduling (was ignored, logged)."""

import httpx
import pytest

from tests.server.fake_engine import FakeEngine, serve_engine


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SAY:ok"}]}),
    ("/v1/completions", {"prompt": "SAY:ok"}),
])
def test_priority_zero_is_served_and_another_is_refused(route, body):
    with serve_engine(FakeEngine()) as url:
        ok = httpx.post(f"{url}{route}", json={"model": "fake", "priority": 0, **body}, timeout=30)
        assert ok.status_code == 200, ok.text
        refused = httpx.post(f"{url}{route}", json={"model": "fake", "priority": -1, **body}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        assert "no priority scheduling" in refused.json()["error"]["message"]
