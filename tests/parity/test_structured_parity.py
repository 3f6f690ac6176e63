"""Structured outputs in the batch, on the real model: each constrained request gets output its
grammar accepts, free requests beside them are unchanged, greedy output is the same batched as
alone and with n-gram speculation on as off, and a grammar that does not compile is refused."""

from __future__ import annotations

import json
import re

import pytest
from test_batched_parity import assert_same_tokens, run_with_joins

from conveyor import LLM, SamplingParams
from conveyor.errors import InvalidRequest
from conveyor.sampling_params import StructuredOutputsParams as Structured

pytest.importorskip("gguf")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
}, "required": ["name", "age", "address"]}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["positive", "negative", "neutral"]

CASES = [   # (prompt, constraint or None, max_tokens)
    ("Describe a person as JSON with name, age, pets and address.", Structured(json=PERSON, strict=True), 80),
    ("Write one short sentence about the sea.", None, 24),
    ("Is this review positive or negative? 'I loved it.'", Structured(choice=CHOICES), 8),
    ("Give me a product code.", Structured(regex=REGEX), 12),
    ("Return a JSON object describing the weather.", Structured(json_object=True), 48),
    ("Copy this list exactly: red, green, blue, red, green, blue, red,", None, 24),
    ("List three fruits as JSON.", Structured(json={"type": "array", "items": {"type": "string", "maxLength": 12},
                                                   "minItems": 3, "maxItems": 3}), 40),
]


def greedy(constraint: Structured | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)


def check(text: str, constraint: Structured | None, finish_reason: str) -> None:
    if constraint is None or finish_reason != "stop":
        return
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def batched(llm: LLM):
    return llm.generate([p for p, _, _ in CASES], [greedy(c, n) for _, c, n in CASES], use_tqdm=False)


def test_each_constrained_request_gets_what_its_grammar_allows(batched) -> None:
    for (_, constraint, _), output in zip(CASES, batched):
        completion = output.outputs[0]
        if constraint is not None and not constraint.json_object:   # bounded grammars end by themselves
            assert completion.finish_reason == "stop", (constraint, completion.text)
        check(completion.text, constraint, completion.finish_reason)


def test_free_requests_are_unchanged_by_constrained_mates(llm: LLM, batched) -> None:
    free = [i for i, (_, c, _) in enumerate(CASES) if c is None]
    alone = llm.generate([CASES[i][0] for i in free], [greedy(None, CASES[i][2]) for i in free], use_tqdm=False)
    assert_same_tokens(alone, [batched[i] for i in free], "free requests beside constrained ones")


def test_constrained_greedy_is_the_same_alone_and_joining_mid_generation(llm: LLM, batched) -> None:
    constrained = [i for i, (_, c, _) in enumerate(CASES) if c is not None]
    alone = [llm.generate([CASES[i][0]], greedy(CASES[i][1], CASES[i][2]), use_tqdm=False)[0] for i in constrained]
    assert_same_tokens(alone, [batched[i] for i in constrained], "constrained alone")
    for i in constrained:
        tokens = run_with_joins(llm.engine, [CASES[i][0]] * 3, greedy(CASES[i][1], CASES[i][2]), every=3,
                                joining=1, prefix=f"c{i}-")
        assert all(t == batched[i].token_ids for t in tokens.values()), f"case {i} differs when joining"


def test_speculation_respects_the_grammar_and_changes_no_token(batched) -> None:
    spec = LLM(max_num_seqs=8, kv_cache_memory="256MiB", speculative="ngram", num_speculative_tokens=4,
               ngram_prompt_lookup_min=1)
    outputs = spec.generate([p for p, _, _ in CASES], [greedy(c, n) for _, c, n in CASES], use_tqdm=False)
    print(f"mismatches={sum(o.token_ids != r.token_ids for o, r in zip(outputs, batched))}")
    assert_same_tokens(outputs, batched, "constrained with speculation")
    assert spec.engine.stats.num_draft_tokens > 0


def test_a_seeded_constrained_request_is_reproducible_and_valid(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured_outputs=Structured(json=PERSON))
    first, second = (llm.generate(["A person as JSON:"], params, use_tqdm=False)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    check(first.outputs[0].text, params.structured_outputs, first.outputs[0].finish_reason)


@pytest.mark.parametrize("constraint", [Structured(regex="(unclosed"), Structured(grammar="root ::= missing_rule"),
                                        Structured(json='{"type": "object", "properties": 3}')])
def test_a_grammar_that_does_not_compile_is_refused_with_the_reason(llm: LLM, constraint: Structured) -> None:
    with pytest.raises(InvalidRequest, match="could not be compiled"):
        llm.engine.add_request("hi", greedy(constraint, 4))
    assert not llm.engine.has_unfinished_requests()
