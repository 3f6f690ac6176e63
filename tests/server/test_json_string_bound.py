"""A JSON string the schema leaves open ends after --json-string-max-tokens tokens through a real server: a
logit bias that makes the model want one letter forever runs the string to max_tokens (invalid JSON) on a
server with the default bound above max_tokens, and stops at the bound with valid JSON on one with a small
bound; a minLength still holds the string open, and a schema's larger maxLength wins over the bound."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import RunningServer, start_server

from conveyor.config import GrammarLimits

BOUND = 8


@pytest.fixture(scope="module")
def bounded_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    pytest.importorskip("xgrammar")
    running = start_server(tiny_checkpoint, max_num_seqs=2,
                           server_options={"grammar": GrammarLimits(json_string_max_tokens=BOUND)})
    yield running
    running.stop()


def _ask(server: RunningServer, string: dict) -> openai.types.CompletionChoice:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    letter = server.engine.tokenizer.encode("a", False)
    assert len(letter) == 1
    schema = {"type": "object", "properties": {"s": {"type": "string", **string}}, "required": ["s"],
              "additionalProperties": False}
    return client.completions.create(model=server.model_name, prompt="s:", max_tokens=48, temperature=0,
                                     logit_bias={str(letter[0]): 100}, extra_body={"guided_json": schema}).choices[0]


def test_an_open_string_runs_to_max_tokens_under_the_default_bound(tiny_server: RunningServer) -> None:
    pytest.importorskip("xgrammar")
    choice = _ask(tiny_server, {})
    assert choice.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.text)


def test_the_bound_closes_the_string_with_valid_json(bounded_server: RunningServer) -> None:
    choice = _ask(bounded_server, {})
    assert choice.finish_reason == "stop", choice.text
    value = json.loads(choice.text)["s"]
    # The opening quote's token counts: BOUND tokens in all, each a letter but (perhaps) the first.
    assert BOUND - 1 <= len(value) <= BOUND and set(value) <= {"a"}, value


def test_min_length_holds_and_a_larger_max_length_wins(bounded_server: RunningServer) -> None:
    held = _ask(bounded_server, {"minLength": 12})
    assert held.finish_reason == "stop" and len(json.loads(held.text)["s"]) == 12
    longer = _ask(bounded_server, {"maxLength": 20})
    assert longer.finish_reason == "stop" and len(json.loads(longer.text)["s"]) == 20
