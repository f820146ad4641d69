"""The README's first command really serves: run its `radiance serve` part (on a free port), get an
answer through the openai client, stop the server with Ctrl-C, and check it exits cleanly."""

import re
import shlex
from pathlib import Path

import openai

from tests.server.live import running_server, stop

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_serve_args() -> list[str]:
    """Arguments after `radiance` of the first `radiance serve` line in the README's code blocks."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.S)
    for block in blocks:
        for line in block.splitlines():
            if "radiance serve" in line:
                words = shlex.split(line.split("radiance serve", 1)[1], comments=True)
                return ["serve"] + [w for w in words if w not in ("&", "&&")]
    raise AssertionError("README.md shows no `radiance serve` command")


def test_readme_first_command_serves():
    args = readme_serve_args()
    with running_server(args) as (url, proc, log, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        code = stop(proc)
    assert code in (0, 130), open(log).read()[-2000:]
    assert "Traceback" not in open(log).read()
