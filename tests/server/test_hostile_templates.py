"""A chat template that would run for hours stops itself: its request gets a 400 in our words
while /health and other requests go on, and `conveyor generate` exits with the same error."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, start_server

from conveyor.cli import generate
from conveyor.cli.flags import parse_args
from conveyor.text import chat_template
from conveyor.text.chat_template import ChatTemplateLimit

NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for m in messages %}"
                "{{ '' }}{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")
BUDGET_S = 1.0


@pytest.fixture(scope="module")
def runaway_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint, max_num_seqs=2, chat_template=NESTED_LOOPS)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def short_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", BUDGET_S)


def test_a_runaway_template_is_stopped_and_the_server_goes_on(runaway_server: RunningServer) -> None:
    base = runaway_server.base_url
    result: list[httpx.Response] = []
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    worker = threading.Thread(target=lambda: result.append(
        httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)))
    worker.start()
    slowest_s = 0.0
    with httpx.Client(base_url=base, timeout=30) as http:
        while worker.is_alive():
            began = time.monotonic()
            assert http.get("/health").status_code == 200
            slowest_s = max(slowest_s, time.monotonic() - began)
            time.sleep(0.05)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    worker.join()
    error = result[0].json()["error"]
    assert result[0].status_code == 400 and error["code"] == "chat_template_limit", result[0].text
    assert "did not finish rendering" in error["message"]
    assert slowest_s < 1.0, slowest_s


@pytest.mark.parametrize("template,words", [
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "value"),
    ("{{ 'x' * 1000000000 }}", "repeated"),
    ("{{ 'x' | center(1000000000) }}", "argument"),
    ("{{ 2 ** 100000000 }}", "power"),
    ("{{ 'x'.ljust(1000000000) }}", "argument"),
    ("{{ '%1000000000s' % 'x' }}", "argument"),
    ("{{ '%*s' % (1000000000, 'x') }}", "argument"),
])
def test_other_runaway_templates_stop_at_once(template: str, words: str) -> None:
    compiled = chat_template.compile_chat_template(template)
    began = time.monotonic()
    with pytest.raises(ChatTemplateLimit, match=words):
        chat_template.render_chat_template(compiled, [{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           bos_token=None, eos_token=None)
    assert time.monotonic() - began < 30


def test_generate_with_a_runaway_template_ends_with_an_error(tiny_checkpoint: Path) -> None:
    args = parse_args(["generate", "hi", "--model", str(tiny_checkpoint), "--threads", "1",
                       "--kv-cache-memory", "64MiB", "--chat-template", NESTED_LOOPS])
    with pytest.raises(ChatTemplateLimit, match="did not finish rendering"):
        generate(args)
