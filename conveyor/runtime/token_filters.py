"""vLLM's allowed_token_ids and bad_words: tokens a row may not sample this step, set to -inf.

allowed_token_ids keeps only the listed tokens. A bad word (as token sequences, tokenized by the
front) blocks its last token whenever the row's output ends with the tokens before it, so the word
is never completed; a one-token word is blocked always.
"""

from __future__ import annotations

import torch

from conveyor.sampling_params import SamplingParams


def apply_token_filters(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """logits (S, V), one row per params and its output so far -> the same with each row's refused tokens
    at -inf; the input is not modified."""
    vocab_size, device = logits.shape[1], logits.device
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if limited:
        refused = torch.ones(len(limited), vocab_size, dtype=torch.bool, device=device)            # (A, V)
        for j, i in enumerate(limited):
            allowed = params[i].allowed_token_ids or []
            refused[j, torch.tensor(allowed, dtype=torch.long, device=device)] = False
        index = torch.tensor(limited, dtype=torch.long, device=device)
        logits = logits.index_copy(0, index, logits.index_select(0, index).masked_fill(refused, float("-inf")))
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, (p, output) in enumerate(zip(params, outputs)):
        for word in p.bad_words_token_ids or ():
            before = len(word) - 1
            if word[-1] < vocab_size and before <= len(output) and output[len(output) - before:] == word[:-1]:
                row_ids.append(i)
                token_ids.append(word[-1])
    if row_ids:
        index_pair = (torch.tensor(row_ids, dtype=torch.long, device=device),
                      torch.tensor(token_ids, dtype=torch.long, device=device))
        logits = logits.index_put(index_pair, torch.tensor(float("-inf"), device=device))
    return logits
