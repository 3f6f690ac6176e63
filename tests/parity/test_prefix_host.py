"""The prefix cache's host memory tier on the real model: blocks evicted from a small KV cache come back
from host memory (not recomputed, the same greedy tokens), the size bound drops the least recently used,
host memory sits in front of the disk (a host miss reads the rest of the chain from disk), and batched
equals alone. On a CUDA GPU the same tests run there too (pinned buffers, copies behind the step's kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.cli.flags import engine_options, parse_args
from conveyor.config import EngineConfig
from conveyor.core.block_manager import hash_block
from conveyor.engine.stats import EngineStats
from conveyor.runtime.kv.host_tier import HostKVTier

pytest.importorskip("gguf")

BS = 16
NUM_KV_BLOCKS = 12   # 192 tokens: the second prompt evicts nearly all of the first one's blocks
BLOCK_NBYTES = 30 * 2 * BS * 3 * 64 * 2   # the bundled model's layers, K and V, KV heads, head dim, float16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA GPU on this machine"))]
WORDS = "harbour ledger grain timber pilot tide berth mole kestrel aurora cargo crane".split()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def engine(device: str, host_blocks: int, **options) -> LLM:  # noqa: ANN003
    on_gpu = {"attention_backend": "sdpa"} if device == "cuda" else {}   # no compile: the tier is what is tested
    return LLM(device=device, num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=256, max_num_seqs=4,
               kv_cache_dtype="float16", prefix_cache_host_size=host_blocks * BLOCK_NBYTES, **on_gpu, **options)


def prompt(llm: LLM, seed: int, num_tokens: int) -> list[int]:
    text = " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(num_tokens))
    ids = llm.tokenizer.encode(text)
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def chain(ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(ids) // BS):
        hashes.append(hash_block(hashes[-1] if hashes else None, ids[i * BS:(i + 1) * BS]))
    return hashes


def counts(stats: EngineStats) -> dict[str, int]:
    return {"prefill": stats.num_prefill_tokens, "hits": stats.num_prefix_hit_tokens,
            "host": stats.host.num_hit_tokens, "disk": stats.disk.num_hit_tokens,
            "host_read": stats.host.bytes_read, "host_written": stats.host.bytes_written}


def delta(before: dict[str, int], llm: LLM) -> dict[str, int]:
    after = counts(llm.engine.stats)
    return {name: after[name] - before[name] for name in after}


def full_tokens(ids: list[int]) -> int:
    return (len(ids) - 1) // BS * BS   # the last prompt token is always computed


def test_evicted_blocks_come_back_from_host_memory(device: str) -> None:
    llm = engine(device, host_blocks=64)
    host = llm.engine.core.prefix_tier.host
    assert host.block_nbytes == BLOCK_NBYTES and llm.engine.core.prefix_tier.store is None
    a, b = prompt(llm, 1, 100), prompt(llm, 2, 170)
    cold = run(llm, [a])
    before = counts(llm.engine.stats)
    warm = run(llm, [a])   # from the KV cache: no host hit
    assert delta(before, llm)["host"] == 0 and delta(before, llm)["hits"] == full_tokens(a)
    assert all(block_hash in host.buffers for block_hash in chain(a)[:6])
    run(llm, [b])   # evicts a's blocks from the KV cache
    assert llm.engine.blocks.cached.keys().isdisjoint(chain(a)[1:6])
    before = counts(llm.engine.stats)
    assert run(llm, [a]) == warm   # the same KV bytes as the hit on the KV cache's own blocks
    used = delta(before, llm)
    assert used["hits"] == full_tokens(a) and used["host"] >= 5 * BS   # block 0 may still be in memory
    assert used["prefill"] == len(a) - full_tokens(a)                   # only the tail was computed
    assert used["host_read"] == used["host"] // BS * BLOCK_NBYTES
    stats = llm.engine.stats
    assert stats.host.nbytes == len(host.buffers) * BLOCK_NBYTES and stats.host.bytes_written > 0
    if device == "cpu":   # a GPU's kernels may round a whole prompt and a tail after cached blocks apart
        plain = LLM(num_kv_blocks=NUM_KV_BLOCKS, kv_cache_dtype="float16", enable_prefix_caching=False)
        assert run(plain, [a]) == cold == warm
    llm.engine.blocks.check_integrity()


def test_the_size_bound_drops_the_least_recently_used(device: str) -> None:
    llm = engine(device, host_blocks=8)
    host = llm.engine.core.prefix_tier.host
    a, b = prompt(llm, 3, 100), prompt(llm, 4, 170)
    cold = run(llm, [a])
    b_out = run(llm, [b])[0]
    assert len(host.buffers) == 8 and host.nbytes == 8 * BLOCK_NBYTES == llm.engine.stats.host.nbytes
    b_blocks = chain(b + b_out)[:(len(b) + len(b_out) - 1) // BS]   # the last token's KV is never computed
    assert len(b_blocks) == 11 and list(host.buffers) == b_blocks[-8:]   # a's blocks and b's first ones went first
    assert not any(block_hash in host.buffers for block_hash in chain(a))
    before = counts(llm.engine.stats)
    assert run(llm, [a]) == cold
    assert delta(before, llm)["host"] == 0   # evicted from both: computed again


def test_host_memory_in_front_of_the_disk(device: str, tmp_path: Path) -> None:
    llm = engine(device, host_blocks=64, prefix_cache_dir=str(tmp_path / "kv"))
    tier = llm.engine.core.prefix_tier
    a, b = prompt(llm, 5, 100), prompt(llm, 6, 170)
    run(llm, [a])
    warm = run(llm, [a])
    assert tier.store.flush(30)
    a_blocks = chain(a)[:6]
    assert all(tier.store.has(block_hash) for block_hash in a_blocks)   # written from the host copies
    run(llm, [b])
    for block_hash in a_blocks[3:]:   # as if the LRU had dropped them: the chain goes on on disk
        del tier.host.buffers[block_hash]
    before = counts(llm.engine.stats)
    assert run(llm, [a]) == warm
    used = delta(before, llm)
    assert used["disk"] == 3 * BS and used["host"] >= 2 * BS
    assert used["hits"] == full_tokens(a) and used["prefill"] == len(a) - full_tokens(a)
    assert all(block_hash in tier.host.buffers for block_hash in a_blocks)   # what the disk gave is kept here
    run(llm, [b])
    del tier.host.buffers[a_blocks[1]]   # a hole: the chain goes on on disk from block 1
    before = counts(llm.engine.stats)
    assert run(llm, [a]) == warm
    used = delta(before, llm)
    assert used["hits"] == full_tokens(a) and used["disk"] >= BS and used["prefill"] == len(a) - full_tokens(a)
    llm.engine.blocks.check_integrity()
    llm.engine.core.close()


def test_batched_equals_alone_with_host_hits(device: str) -> None:
    llm = engine(device, host_blocks=64)
    shared = prompt(llm, 7, 64)   # four blocks
    prompts = [shared + prompt(llm, 8 + i, 9 + 5 * i) for i in range(3)]
    for p in prompts:
        run(llm, [p])
    alone = [run(llm, [p])[0] for p in prompts]   # each hits all its full blocks, as each will in the batch
    run(llm, [prompt(llm, 11, 170)])   # the shared blocks leave the KV cache; host memory keeps them
    before = counts(llm.engine.stats)
    assert run(llm, prompts) == alone
    used = delta(before, llm)
    # Every full block came back: the four shared ones copied in once, then shared; the last prompt's fifth too.
    assert used["hits"] == sum(full_tokens(p) for p in prompts) == 13 * BS and used["host"] == 5 * BS


def test_an_int8_cache_moves_its_codes_and_scales() -> None:
    llm = LLM(num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=256, kv_cache_dtype="int8",
              prefix_cache_host_size="64MiB")
    a, b = prompt(llm, 12, 100), prompt(llm, 13, 170)
    run(llm, [a])
    warm = run(llm, [a])
    run(llm, [b])
    before = counts(llm.engine.stats)
    assert run(llm, [a]) == warm
    used = delta(before, llm)
    assert used["host"] >= 5 * BS and used["hits"] == full_tokens(a) and used["prefill"] == len(a) - full_tokens(a)


def test_host_size_options() -> None:
    config = EngineConfig.from_options(**engine_options(parse_args(["serve", "--prefix-cache-host-size", "8G"])))
    assert config.cache.prefix_cache_host_size == "8G" and config.cache.prefix_cache_dir is None
    assert EngineConfig.from_options(prefix_cache_host_size="0").cache.prefix_cache_host_size == "0"   # off
    with pytest.raises(ValueError, match="prefix_cache_host_size needs enable_prefix_caching"):
        EngineConfig.from_options(prefix_cache_host_size="1G", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix_cache_host_size must be a size"):
        EngineConfig.from_options(prefix_cache_host_size="lots")
    with pytest.raises(ValueError, match="holds no block"):
        LLM(prefix_cache_host_size=1000)
    assert LLM(num_kv_blocks=4).engine.core.prefix_tier is None   # off by default


def test_host_tier_copies_bytes_and_keeps_the_most_recently_used() -> None:
    kv = torch.arange(2 * 2 * 5 * 3, dtype=torch.float16).view(2, 2, 5, 3)   # (L, 2, blocks, block elements)
    host = HostKVTier(block_nbytes=2 * 2 * 3 * 2, max_bytes=3 * 24 + 5, device=torch.device("cpu"))
    copied, ready = host.copy_out(kv, [(b"a", 0), (b"b", 1), (b"c", 2)])
    assert ready is None and [h for h, _ in copied] == [b"a", b"b", b"c"] and host.nbytes == 72
    assert torch.equal(host.get(b"b").view(torch.float16).view(2, 2, 3), kv[:, :, 1])   # b is now the most recent
    host.touch([b"a", b"x"])
    copied, _ = host.copy_out(kv, [(b"c", 2), (b"d", 3)])   # c is here already (now the most recent)
    assert [h for h, _ in copied] == [b"d"] and list(host.buffers) == [b"a", b"c", b"d"]   # b was least recent
    assert host.num_leading([b"a", b"c", b"b", b"d"]) == 2 and host.bytes_written == 4 * 24
    dest = torch.zeros(2, 2, 3, dtype=torch.float16)
    host.copy_in(host.get(b"d"), dest)
    assert torch.equal(dest, kv[:, :, 3]) and host.bytes_read == 24
