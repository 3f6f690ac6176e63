"""The core's grammar side on a tiny real tokenizer: compile errors name the reason, masks follow the
drafts and leave the matcher where it was, and emitted tokens advance it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.engine.structured_output import GrammarCompiler, StructuredOutputs
from conveyor.text.tokenizer_loader import load_tokenizer
from conveyor.errors import InvalidRequest
from conveyor.runtime.sampler import unpack_bitmask
from conveyor.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

VOCAB = 320   # the tiny models' logits width, past the tokenizer's 300 ids


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: tokenizer, VOCAB)


def ready(compiler: GrammarCompiler, spec: StructuredOutputsParams, request_id: str = "r") -> StructuredOutputs:
    structured = StructuredOutputs(compiler)
    structured.submit(request_id, spec)
    while structured.num_compiling:
        structured.wait(1.0)
        assert structured.take_compiled() in ([], [(request_id, None)])
    assert structured.is_constrained(request_id)
    return structured


def allowed(masks: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().squeeze(1).tolist()) for row in unpack_bitmask(masks, VOCAB)]


def char(tokenizer, text: str) -> int:
    [token_id] = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def test_masks_follow_the_drafts_and_roll_back(tokenizer, compiler: GrammarCompiler) -> None:
    structured = ready(compiler, StructuredOutputsParams(regex="ab"))
    a, b, x = char(tokenizer, "a"), char(tokenizer, "b"), char(tokenizer, "x")
    eos = sorted(tokenizer.eos_token_ids)[0]
    masks = allowed(structured.masks("r", [a, b, eos, x]))
    assert masks[0] == {a} and masks[1] == {b} and masks[2] == {eos}
    assert masks[3] == masks[2]                       # past a drafted eos nothing is emitted
    assert allowed(structured.masks("r", [])) == [{a}]   # the walk through the drafts was rolled back
    refused = allowed(structured.masks("r", [x, a]))
    assert refused[0] == {a} and refused[1] == refused[0]   # past a refused draft the mask is kept
    assert structured.accept("r", [a])
    assert allowed(structured.masks("r", [])) == [{b}]
    assert not structured.accept("r", [x])
    structured.drop("r")
    assert not structured.is_constrained("r")


def test_every_vocabulary_id_past_the_tokenizer_is_refused(compiler: GrammarCompiler) -> None:
    structured = ready(compiler, StructuredOutputsParams(json_object=True))
    [first] = allowed(structured.masks("r", []))
    assert first and max(first) < 300


def test_a_failed_compile_reaches_the_core_as_an_error(compiler: GrammarCompiler) -> None:
    structured = StructuredOutputs(compiler)
    structured.submit("bad", StructuredOutputsParams(regex="(unclosed"))
    structured.wait(5.0)
    [(request_id, error)] = structured.take_compiled()
    assert request_id == "bad" and error is not None and "could not be compiled" in error
    assert not structured.is_constrained("bad")


@pytest.mark.parametrize("spec", [StructuredOutputsParams(regex="(unclosed"),
                                  StructuredOutputsParams(grammar="root ::= nothing"),
                                  StructuredOutputsParams(structural_tag='{"type": "nope"}')])
def test_compile_errors_name_the_param(compiler: GrammarCompiler, spec: StructuredOutputsParams) -> None:
    with pytest.raises(InvalidRequest, match="could not be compiled") as info:
        compiler.compile(spec, param="guided_regex")
    assert info.value.param == "guided_regex"


def test_a_steps_masks_in_one_batched_fill_equal_each_rows_own(tokenizer, compiler: GrammarCompiler) -> None:
    structured = StructuredOutputs(compiler, num_threads=2)
    specs = {"json": StructuredOutputsParams(json_object=True), "re": StructuredOutputsParams(regex="ab|ac"),
             "choice": StructuredOutputsParams(choice=["xy", "z"])}
    for request_id, spec in specs.items():
        structured.submit(request_id, spec)
    while structured.num_compiling:
        structured.wait(1.0)
        structured.take_compiled()
    a = char(tokenizer, "a")
    assert structured.accept("re", [a])
    batched = structured.step_masks([("json", []), ("re", []), ("choice", [char(tokenizer, "x")])])
    for request_id, drafts in (("json", []), ("re", []), ("choice", [char(tokenizer, "x")])):
        assert torch.equal(batched[request_id], structured.masks(request_id, drafts)), request_id
    assert allowed(batched["re"]) == [{char(tokenizer, "b"), char(tokenizer, "c")}]


def test_a_loaded_tokenizer_is_used_until_the_compiler_is_built(tokenizer) -> None:
    def load_again():
        raise AssertionError("the tokenizer was loaded again")

    compiler = GrammarCompiler(load_again, VOCAB)
    compiler.use_tokenizer(lambda: tokenizer)
    compiler.compile(StructuredOutputsParams(regex="a+"))
    compiler.use_tokenizer(load_again)   # built already: the compiler keeps its vocabulary
    compiler.compile(StructuredOutputsParams(regex="b+"))
