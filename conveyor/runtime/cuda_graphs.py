"""Decode steps on a CUDA GPU, replayed from CUDA graphs.

Run eagerly, a decode step launches ~37 kernels per decoder layer, and launching them is the step's
cost: on an H200, 31 ms of CPU per step against 2-3 ms of GPU work for a 135M model. A CUDA graph
records a step's launches once and replays them with one call. A graph has fixed shapes and fixed
addresses, so one is captured per (rows, key blocks) bucket, on first use, over a static input
tensor that each step fills: token, position, cache slot, context length and block table per row.
Rows past the step's own are padding: they read and write only the cache's spare block, which no
request owns. The graph ends at the last layer's hidden states; the final norm and the output layer
run eagerly on the rows to sample (a few launches, and no per-graph logits buffer kept alive).

Prompt chunks, speculative verification and steps larger than the biggest bucket run eagerly.

With FlexAttention the graph builds its block masks from the same static inputs (flex_paged.py: tensor
arithmetic only); its buckets start at 2 rows and 2 blocks, as the eager path pads them, so that
the compiled attention sees no size of 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.core.plan import ScheduledRow, StepPlan
from conveyor.model.attention_backends import flex_paged
from conveyor.model.attention import AttentionGroup, AttentionMetadata
from conveyor.model.llama import LlamaModel
from conveyor.runtime.kv.cache import KVCache

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
_COLUMNS = 4   # token, position, slot, context length; the block table follows


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], object]
    inputs: torch.Tensor     # (rows, 4 + blocks) int64 on the GPU, filled before each replay
    host: torch.Tensor       # the same in host memory (pinned on a GPU), where a step's rows are written
    hidden: torch.Tensor     # (rows, hidden) the last layer's output
    constants: tuple[torch.Tensor, ...]   # tensors the graph reads but did not allocate: kept alive with it


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, max_rows: int, max_blocks: int,
                 flex: bool = False) -> None:
        if kv_cache.spare_block is None:
            raise ValueError("CUDA graphs need a KV cache with a spare block for their padding rows")
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.tensor.device
        self.block_size = kv_cache.block_size
        self.window = model.arch.sliding_window
        self.flex = flex
        least = 2 if flex else 1
        self.batch_sizes = sorted({max(b, least) for b in BATCH_SIZES if b < max_rows} | {max(max_rows, least)})
        self.block_counts = sorted({max(1 << i, least) for i in range(max_blocks.bit_length()) if 1 << i < max_blocks}
                                   | {max(max_blocks, least)})
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None
        self.failed: str | None = None   # why capturing failed; every step then runs eagerly

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits (S, V) float32 of the plan's sampling rows; None where the step is not one a graph
        replays (a prompt chunk, guesses to verify, past the buckets) or no graph could be captured."""
        rows = plan.rows
        if (self.failed is not None or not 0 < len(rows) <= self.batch_sizes[-1]
                or any(r.num_tokens != 1 or r.num_draft_tokens or r.num_prompt_logits for r in rows)):
            return None
        longest = max(len(r.block_table) for r in rows)
        if longest > self.block_counts[-1]:
            return None
        size = next(b for b in self.batch_sizes if b >= len(rows))
        blocks = next(n for n in self.block_counts if n >= longest)
        graph = self.graphs.get((size, blocks)) or self._capture(size, blocks)
        if graph is None:
            return None
        self._fill(graph, rows, blocks)
        graph.inputs.copy_(graph.host, non_blocking=True)   # the host buffer is not rewritten before the step's sync
        graph.replay()
        sampling = [i for i, r in enumerate(rows) if r.is_sampling]
        hidden = graph.hidden[:len(rows)] if len(sampling) == len(rows) else \
            graph.hidden[torch.tensor(sampling, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    def _fill(self, graph: _Graph, rows: list[ScheduledRow], blocks: int) -> None:
        """Write the rows' token, position, cache slot, context length and block table into the graph's
        host buffer (numpy: a Python list per row cost ~1 ms a step at 256 rows); padding rows after."""
        host, n, bs = graph.host.numpy(), len(rows), self.block_size
        host[:n] = 0
        for i, r in enumerate(rows):
            host[i, _COLUMNS:_COLUMNS + len(r.block_table)] = r.block_table
        positions = np.fromiter((r.start_position for r in rows), dtype=np.int64, count=n)
        host[:n, 0] = [r.token_ids[0] for r in rows]
        host[:n, 1] = positions
        host[:n, 2] = host[np.arange(n), _COLUMNS + positions // bs] * bs + positions % bs
        host[:n, 3] = positions + 1
        host[n:] = self._padding_row(blocks)

    def _padding_row(self, blocks: int) -> list[int]:
        spare = self.kv_cache.spare_block
        return [0, 0, spare * self.block_size, 1, spare, *[0] * (blocks - 1)]

    def _flex_metadata(self, inputs: torch.Tensor, rows: torch.Tensor) -> AttentionMetadata:
        """One decode query per row, its block masks built on the device from the static inputs."""
        windows = (None,) if self.window is None else (None, self.window)
        group = flex_paged.flex_group(
            rows[:, None], inputs[:, 3] - 1, torch.ones_like(rows), inputs[:, _COLUMNS:], rows, rows,
            self.block_size, self.kv_cache.tensor.shape[2], windows, flex_paged.DECODE_Q_BLOCK)
        return AttentionMetadata(slot_mapping=inputs[:, 2].contiguous(), groups=[], flex=flex_paged.FlexPlan([group]))

    def _capture(self, size: int, blocks: int) -> _Graph | None:
        inputs = torch.tensor([self._padding_row(blocks)] * size, dtype=torch.long, device=self.device)
        key_pos = torch.arange(blocks * self.block_size, device=self.device)
        rows = torch.arange(size, device=self.device)
        window = self.window

        def sdpa_metadata() -> AttentionMetadata:
            context = inputs[:, 3:4]                                                   # (B, 1)
            mask = key_pos[None, :] < context                                          # (B, Lk)
            window_mask = None if window is None else (mask & (key_pos[None, :] >= context - window))[:, None, None]
            group = AttentionGroup(query_index=rows[:, None], block_tables=inputs[:, _COLUMNS:],
                                   mask=mask[:, None, None], window_mask=window_mask, out_rows=rows, out_tokens=rows)
            return AttentionMetadata(slot_mapping=inputs[:, 2].contiguous(), groups=[group])

        def forward() -> torch.Tensor:
            meta = self._flex_metadata(inputs, rows) if self.flex else sdpa_metadata()
            return self.model.hidden_states(inputs[:, 0].contiguous(), inputs[:, 1].contiguous(), meta,
                                            self.kv_cache.layers)

        if self.device.type != "cuda":   # no graphs off a GPU: the same static inputs, run eagerly (tests)
            hidden = forward()
            captured = _Graph(lambda: hidden.copy_(forward()), inputs, inputs.clone(), hidden, (key_pos, rows))
            self.graphs[(size, blocks)] = captured
            return captured
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream(self.device)   # warm-up off the capture (lazy inits, workspaces)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = forward()
        except RuntimeError as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("CUDA graphs off, every step runs eagerly: capturing a decode step failed (%s)",
                           self.failed)
            return None
        self.pool = graph.pool()
        host = torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True)
        captured = self.graphs[(size, blocks)] = _Graph(graph.replay, inputs, host, hidden, (key_pos, rows))
        logger.debug("captured a CUDA graph for %d rows over %d key blocks", size, blocks)
        return captured
