"""The prefix cache's disk tier on the real model and real files: a restart finds the blocks, a bad or
foreign file is a miss with the same tokens, two engines share one folder."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.block_manager import hash_block
from conveyor.runtime.kv import prefix_tier

pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TEXT = ("A ledger of the harbour: the Aurora unloads grain at berth 3, the Kestrel takes on timber at "
        "berth 5, the pilot boat waits by the north mole, and the tide turns at four. ") * 5


def engine(folder: Path, **options) -> LLM:  # noqa: ANN003
    return LLM(prefix_cache_dir=str(folder), kv_cache_memory="64MiB", max_num_batched_tokens=512, **options)


def run(llm: LLM, prompt: str | list[int]) -> list[int]:
    return list(llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids)


def stop(llm: LLM) -> None:
    llm.engine.core.close()   # the writer finishes what it has queued


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], list[int]]:
    """A folder filled by one engine's run of the prompt: (folder, prompt ids, greedy tokens)."""
    folder = tmp_path_factory.mktemp("kv")
    llm = engine(folder)
    prompt_ids = llm.tokenizer.encode(TEXT)
    tokens = run(llm, prompt_ids)
    stop(llm)
    assert llm.engine.stats.disk.num_hit_tokens == 0
    assert len(block_files(folder)) >= len(prompt_ids) // 16
    return folder, prompt_ids, tokens


@pytest.fixture(scope="module")
def plain() -> LLM:
    """The same engine without a prefix cache: the tokens every cached run must give."""
    return LLM(kv_cache_memory="64MiB", max_num_batched_tokens=512, enable_prefix_caching=False)


def copy_folder(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)   # modes too: the store reads only private files
    return dest


def chain_hashes(prompt_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(prompt_ids) // 16):
        hashes.append(hash_block(hashes[-1] if hashes else None, prompt_ids[i * 16:(i + 1) * 16]))
    return hashes


def test_restart_reads_the_prompt_back_instead_of_computing_it(reference, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, tokens = reference
    llm = engine(copy_folder(folder, tmp_path / "kv"))
    assert run(llm, prompt_ids) == tokens
    stats = llm.engine.stats
    full = (len(prompt_ids) - 1) // 16 * 16
    assert stats.disk.num_hit_tokens == full and stats.num_prefix_hit_tokens == full
    assert stats.num_prefill_tokens == len(prompt_ids) - full   # only the tail was computed
    assert stats.disk.bytes_read >= full * 1000
    stop(llm)


def test_damaged_files_are_misses_with_the_same_tokens(reference, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, tokens = reference
    copy = copy_folder(folder, tmp_path / "kv")
    llm = engine(copy)
    store = llm.engine.core.prefix_tier.store
    damaged = store.path_for(chain_hashes(prompt_ids)[3])
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10          # one bit of the KV: the checksum catches it
    damaged.write_bytes(bytes(data))
    assert run(llm, prompt_ids) == tokens
    assert llm.engine.stats.disk.num_hit_tokens == 3 * 16   # the blocks before the first bad one
    assert store.num_bad_files == 1
    assert llm.engine.blocks.num_used_blocks == 0
    stop(llm)
    assert damaged.exists() and store.read(chain_hashes(prompt_ids)[3]) is not None   # written again, whole


def test_another_kv_dtype_is_another_cache(reference, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, _ = reference
    copy = copy_folder(folder, tmp_path / "kv")
    llm = engine(copy, kv_cache_dtype="float32")
    plain = LLM(kv_cache_memory="64MiB", max_num_batched_tokens=512, kv_cache_dtype="float32",
                enable_prefix_caching=False)
    assert run(llm, prompt_ids) == run(plain, prompt_ids)
    assert llm.engine.stats.disk.num_hit_tokens == 0 and llm.engine.stats.num_prefix_hit_tokens == 0
    stop(llm)
    assert len({p.parent for p in block_files(copy)}) == 2   # each fingerprint has a folder of its own


def test_two_engines_share_a_folder(reference, plain: LLM, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, tokens = reference
    shared = copy_folder(folder, tmp_path / "kv")
    a, b = engine(shared), engine(shared)
    other = prompt_ids[:40] + prompt_ids[::-1][:200]
    # Both compute the same new prompt and write its blocks at once; then each finds the other's.
    assert run(a, other) == run(b, other)
    a.engine.core.prefix_tier.store.flush(30)
    b.engine.core.prefix_tier.store.flush(30)
    assert run(b, prompt_ids) == tokens and b.engine.stats.disk.num_hit_tokens > 0
    stop(a)
    c = engine(shared)
    expected = run(plain, other)
    assert run(c, other) == expected
    assert c.engine.stats.disk.num_hit_tokens == (len(other) - 1) // 16 * 16
    stop(b)
    stop(c)
    assert not list(shared.glob("*/.*.tmp"))


def slow_reads(llm: LLM, delay_s: float) -> None:
    """Every block read takes `delay_s` more: a slow disk (the files and the checks stay real)."""
    store = llm.engine.core.prefix_tier.store
    read = store.read

    def slow(block_hash: bytes):  # noqa: ANN202
        time.sleep(delay_s)
        return read(block_hash)

    store.read = slow


def test_a_slow_disk_never_holds_up_a_step(reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    folder, prompt_ids, tokens = reference
    llm = engine(copy_folder(folder, tmp_path / "kv"))
    core = llm.engine.core
    slow_reads(llm, 0.05)
    monkeypatch.setattr(prefix_tier, "_MAX_HOLD_S", 0.3)   # then what is not read is computed
    llm.engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="a")
    llm.engine.step()
    llm.engine.add_request(prompt_ids, GREEDY, request_id="b")
    assert "b" in core.prefix_tier.held
    streamed = sum(len(o.new_token_ids) for o in llm.engine.step() if o.request_id == "a")
    assert streamed == 1 and "b" in core.prefix_tier.held   # a decoded while b's blocks were being read
    done: dict[str, list[int]] = {"a": [], "b": []}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            done[output.request_id] += output.new_token_ids
    assert done["b"] == tokens
    hits = core.stats.disk.num_hit_tokens
    assert 0 < hits < (len(prompt_ids) - 1) // 16 * 16   # some blocks in time, the rest computed
    core.blocks.check_integrity()
    stop(llm)


def test_abort_while_reading(reference, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, tokens = reference
    llm = engine(copy_folder(folder, tmp_path / "kv"))
    core = llm.engine.core
    slow_reads(llm, 0.02)
    llm.engine.add_request(prompt_ids, GREEDY, request_id="b")
    assert "b" in core.prefix_tier.held and llm.engine.has_unfinished_requests()
    assert llm.engine.abort_request("b")
    assert not core.prefix_tier.held and not llm.engine.has_unfinished_requests()
    assert run(llm, prompt_ids) == tokens
    assert core.blocks.num_used_blocks == 0
    stop(llm)


def test_a_folder_others_can_write_is_refused_at_start(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="only this user can write"):
        engine(shared)


def test_prompts_sharing_a_prefix_read_it_once(reference, plain: LLM, tmp_path: Path) -> None:  # noqa: ANN001
    folder, prompt_ids, _ = reference
    llm = engine(copy_folder(folder, tmp_path / "kv"))
    prompts = [prompt_ids + [11 + i] * 20 for i in range(3)]
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    stats, num_files = llm.engine.stats, len(prompt_ids) // 16
    assert stats.disk.bytes_read <= num_files * llm.engine.core.prefix_tier.store.block_nbytes * 1.01   # once
    # The first prompt to use a block read back counts a disk hit, the others a memory hit.
    assert stats.disk.num_hit_tokens == num_files * 16 and stats.num_prefix_hit_tokens == 3 * num_files * 16
    stop(llm)
