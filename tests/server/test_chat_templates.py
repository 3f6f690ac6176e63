"""Chat templates as the families ship them, through a real server: Gemma's template (no system role
of its own, raises on turns out of order) and a base model with no template at all."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import RunningServer, start_server
from test_errors import assert_error

# Gemma 3's chat template as its tokenizer_config.json carries it: a system message is folded into the
# first user turn, the assistant is called "model", and turns out of order raise.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""


@pytest.fixture(scope="module")
def gemma_server(tiny_checkpoint_factory: Callable[[str], Path]) -> Iterator[RunningServer]:
    running = start_server(tiny_checkpoint_factory("gemma3"), max_num_seqs=2, chat_template=GEMMA_TEMPLATE)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def base_model_server(tiny_checkpoint_factory: Callable[[str], Path],
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A checkpoint whose tokenizer has no chat template (a base model)."""
    folder = tmp_path_factory.mktemp("base") / "gemma3-base"
    shutil.copytree(tiny_checkpoint_factory("gemma3"), folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    running = start_server(folder, max_num_seqs=2)
    yield running
    running.stop()


def _chat(server: RunningServer, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": server.model_name, "messages": messages, "max_tokens": 3})


def test_gemma_template_folds_the_system_message_into_the_first_turn(gemma_server: RunningServer) -> None:
    response = _chat(gemma_server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("roles", [("user", "user"), ("assistant", "user"), ("system", "assistant")])
def test_turns_out_of_order_are_a_400_in_the_templates_words(gemma_server: RunningServer,
                                                             roles: tuple[str, ...]) -> None:
    error = assert_error(_chat(gemma_server, [{"role": r, "content": "hi"} for r in roles]), 400,
                         "invalid_request_error")
    assert "Conversation roles must alternate" in error["message"]
    # The server is unharmed: the next good request is answered.
    assert _chat(gemma_server, [{"role": "user", "content": "hi"}]).status_code == 200


def test_base_model_without_a_template_refuses_chat_and_serves_completions(base_model_server: RunningServer) -> None:
    error = assert_error(_chat(base_model_server, [{"role": "user", "content": "hi"}]), 400, "invalid_request_error")
    assert "no chat template" in error["message"]
    response = httpx.post(f"{base_model_server.base_url}/v1/completions", timeout=60,
                          json={"model": base_model_server.model_name, "prompt": "Once upon", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None
