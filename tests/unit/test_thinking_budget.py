"""ThinkingBudgets on token streams: counting from the start or from an opening tag, a natural end,
forcing the whole end tag (or only its rest) past the budget, and requests that never think."""

from __future__ import annotations

import torch

from conveyor.engine.thinking_budget import ThinkingBudgets
from conveyor.runtime.sampler import unpack_bitmask
from conveyor.sampling_params import ThinkingBudget

START, END = (7, 8), (40, 41, 42)   # multi-token tags, as a vocabulary without think tokens writes them
VOCAB = 100


def budget(max_tokens: int, inside: bool) -> ThinkingBudget:
    return ThinkingBudget(max_tokens=max_tokens, starts_inside=inside, start_token_ids=START, end_token_ids=END)


def forced(budgets: ThinkingBudgets, request_id: str) -> int | None:
    masks = budgets.forced_masks([request_id])
    if request_id not in masks:
        return None
    allowed = unpack_bitmask(masks[request_id], VOCAB)[0].nonzero().flatten().tolist()
    assert len(allowed) == 1
    return allowed[0]


def run(budgets: ThinkingBudgets, request_id: str, free_tokens: list[int], steps: int) -> list[int]:
    """Step like the core: the forced token when there is one, else the next free token."""
    out, free = [], iter(free_tokens)
    for _ in range(steps):
        token = forced(budgets, request_id)
        token = next(free) if token is None else token
        out.append(token)
        budgets.accept(request_id, [token])
    return out


def test_budget_from_the_start_forces_the_end_tag_then_lets_go() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(3, inside=True))
    assert run(budgets, "a", list(range(10, 30)), 9) == [10, 11, 12, 40, 41, 42, 13, 14, 15]
    assert "a" not in budgets


def test_budget_counts_from_the_opening_tag() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(2, inside=False))
    assert run(budgets, "a", [7, 8, 20, 21, 22, 23], 7) == [7, 8, 20, 21, 40, 41, 42]


def test_zero_budget_closes_at_once() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(0, inside=True))
    assert run(budgets, "a", [20, 21], 5) == [40, 41, 42, 20, 21]


def test_natural_end_within_the_budget_forces_nothing() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(10, inside=True))
    assert run(budgets, "a", [20, 40, 41, 42, 21, 22, 23, 24, 25, 26, 27, 28], 12) == \
        [20, 40, 41, 42, 21, 22, 23, 24, 25, 26, 27, 28]


def test_an_end_tag_begun_at_the_budget_is_only_finished() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(3, inside=True))
    assert run(budgets, "a", [20, 21, 40, 30, 31], 5) == [20, 21, 40, 41, 42]


def test_an_output_that_does_not_open_the_thinking_is_never_forced() -> None:
    budgets = ThinkingBudgets(VOCAB)
    budgets.add("a", budget(0, inside=False))
    assert run(budgets, "a", [7, 9, 20, 21], 4) == [7, 9, 20, 21]
    assert "a" not in budgets


def test_high_token_ids_set_the_sign_bit_of_their_word() -> None:
    budgets = ThinkingBudgets(64)
    budgets.add("a", ThinkingBudget(max_tokens=0, starts_inside=True, start_token_ids=(1,), end_token_ids=(63,)))
    mask = budgets.forced_masks(["a"])["a"]
    assert mask.dtype == torch.int32 and unpack_bitmask(mask, 64)[0].nonzero().flatten().tolist() == [63]
