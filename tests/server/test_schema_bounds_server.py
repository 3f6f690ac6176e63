"""An integer the JSON schema leaves unbounded ends within JSON's safe range through a real server: a
logit bias that makes the model want digits forever still gives valid JSON that stops, not digits
until max_tokens."""

from __future__ import annotations

import json

import openai
import pytest
from server_helpers import RunningServer

from conveyor.engine.schema_bounds import MAX_SAFE_INTEGER


def test_an_unbounded_integer_stops_at_the_safe_range(tiny_server: RunningServer) -> None:
    pytest.importorskip("xgrammar")
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0)
    tokenizer = tiny_server.engine.tokenizer
    digits = {str(tokenizer.encode(d, False)[0]): 100 for d in "123456789"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    reply = client.completions.create(
        model=tiny_server.model_name, prompt="n:", max_tokens=48, temperature=0, logit_bias=digits,
        extra_body={"guided_json": schema})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.text
    value = json.loads(choice.text)["n"]
    assert 10**14 <= abs(value) <= MAX_SAFE_INTEGER   # the bias ran it to the bound, not past it
