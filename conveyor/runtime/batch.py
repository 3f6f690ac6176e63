"""StepPlan -> one packed batch: token ids, positions, attention metadata, rows to sample. No padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.core.plan import StepPlan
from conveyor.model.attention import AttentionMetadata, RowSpec, build_metadata


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor        # (T,) the new tokens of every row, concatenated
    positions: torch.Tensor        # (T,) each token's position in its own sequence
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # (S + P,) the last token of each sampling row (with drafts, its last
                                   # 1 + drafts), then the P positions that score prompt tokens, row by row
    sampling_ids: list[str]        # request ids of the sampling rows, in order (one per row, not per logit)


def build_batch(plan: StepPlan, block_size: int, sliding_window: int | None,
                device: torch.device, kernel_tile_size: int = 0, flex_cache_blocks: int = 0) -> Batch:
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[RowSpec] = []
    logits_indices: list[int] = []
    sampling_ids: list[str] = []
    prompt_indices: list[int] = []
    for row in plan.rows:
        start = len(input_ids)
        prompt_indices.extend(range(start, start + row.num_prompt_logits))
        input_ids.extend(row.token_ids)
        positions.extend(range(row.start_position, row.start_position + row.num_tokens))
        rows.append(RowSpec(start, row.num_tokens, row.start_position + row.num_tokens, row.block_table))
        if row.is_sampling:
            logits_indices.extend(range(len(input_ids) - row.num_logits, len(input_ids)))
            sampling_ids.append(row.request_id)
    return Batch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=build_metadata(rows, block_size, sliding_window, device, kernel_tile_size, flex_cache_blocks),
        logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long, device=device),
        sampling_ids=sampling_ids,
    )
