"""A seeded fuzzer over GGUF structure: mutations of a valid tiny file (dimensions, dimension counts,
types, offsets, metadata values and types, tensors dropped or repeated, truncation, flipped header
bytes, NaN scales) each either load or fail with our clean error; never a crash, a hang or another
exception type. The loads run in a child process, so a segfault fails this test instead of ending pytest.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gguf_craft import ARRAY, FLOAT32, INT32, STRING, UINT32, UINT64, Spec, encode, tiny_spec

CASES = 250            # about 10 s of loads on two busy cores
SEED = 20261127
CHILD = Path(__file__).with_name("gguf_fuzz_child.py")
ARCH_KEYS = ["llama.block_count", "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
             "llama.rope.dimension_count", "llama.vocab_size", "general.alignment",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"]
EDGE_INTS = [0, 1, 2, 3, 7, 31, 63, 65, 255, 4096, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1,
             (1 << 64) - 1]
TYPE_IDS = list(range(0, 42)) + [255, 1 << 31]


def _int(rng: random.Random, old: int) -> int:
    return rng.choice([*EDGE_INTS, old * 2, old // 2, old + 1, max(old - 1, 0), old * 4])


def _dims(spec: Spec, rng: random.Random) -> str:
    t = rng.choice(spec.tensors)
    i = rng.randrange(len(t.dims))
    t.dims[i] = _int(rng, t.dims[i])
    return f"{t.name} dims -> {t.dims}"


def _num_dims(spec: Spec, rng: random.Random) -> str:
    t = rng.choice(spec.tensors)
    t.dims = t.dims[:-1] if len(t.dims) > 1 and rng.random() < 0.5 else [*t.dims, rng.choice([1, 2, 0])]
    return f"{t.name} dims -> {t.dims}"


def _type(spec: Spec, rng: random.Random) -> str:
    t = rng.choice(spec.tensors)
    t.type_id = rng.choice(TYPE_IDS)
    return f"{t.name} type -> {t.type_id}"


def _offset(spec: Spec, rng: random.Random) -> str:
    t = rng.choice(spec.tensors)
    t.offset = rng.choice([0, 1, 32, 64, 4096, 1 << 40, (1 << 64) - 1, rng.randrange(0, 200_000)])
    return f"{t.name} offset -> {t.offset}"


def _metadata(spec: Spec, rng: random.Random) -> str:
    key = rng.choice(ARCH_KEYS)
    kind = rng.random()
    if kind < 0.6:
        spec.kv[key] = (UINT64 if rng.random() < 0.5 else UINT32, _int(rng, 64) & 0xFFFFFFFF) \
            if rng.random() < 0.5 else (UINT64, _int(rng, 64))
    elif kind < 0.7:
        spec.kv[key] = (INT32, rng.choice([-1, -(1 << 31)]))
    elif kind < 0.8:
        spec.kv[key] = (FLOAT32, rng.choice([0.5, float("nan"), 1e30]))
    elif kind < 0.9:
        spec.kv[key] = (STRING, "64")
    else:
        spec.kv[key] = (ARRAY, (UINT32, [64, 128]))
    return f"{key} -> {spec.kv[key]}"


def _tensor_list(spec: Spec, rng: random.Random) -> str:
    i = rng.randrange(len(spec.tensors))
    if rng.random() < 0.5:
        return f"dropped {spec.tensors.pop(i).name}"
    spec.tensors.insert(rng.randrange(len(spec.tensors)), spec.tensors[i])
    return f"repeated {spec.tensors[i].name}"


def _nan(spec: Spec, rng: random.Random) -> str:
    t = rng.choice(spec.tensors)
    data = bytearray(t.data)
    at = rng.randrange(0, len(data) - 1)
    data[at: at + 2] = rng.choice([b"\x00\x7c", b"\x00\xfe", b"\xff\x7f"])
    t.data = bytes(data)
    return f"{t.name} bytes {at}.. -> inf/nan"


MUTATIONS: list[Callable[[Spec, random.Random], str]] = [_dims, _dims, _num_dims, _type, _offset, _metadata,
                                                         _metadata, _tensor_list, _nan]


def _case(rng: random.Random) -> tuple[bytes, str]:
    spec = tiny_spec(kquant=rng.random() < 0.3, seed=rng.randrange(3))
    notes = [rng.choice(MUTATIONS)(spec, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
    data = encode(spec)
    roll = rng.random()
    if roll < 0.15:
        cut = rng.randrange(0, len(data))
        data, notes = data[:cut], [*notes, f"truncated at {cut}"]
    elif roll < 0.3:
        head = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(8, min(len(head), 4096))
            head[at] = rng.randrange(256)
        data, notes = bytes(head), [*notes, "header bytes flipped"]
    return data, "; ".join(notes)


def test_mutated_gguf_files_load_or_fail_cleanly(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    rng = random.Random(SEED)
    paths, notes = [], []
    for i in range(CASES):
        data, note = _case(rng)
        path = tmp_path / f"case-{i}.gguf"
        path.write_bytes(data)
        paths.append(str(path))
        notes.append(note)
    sanitize = ["--sanitize"] if request.config.getoption("--sanitize") else []
    result = subprocess.run([sys.executable, str(CHILD), *sanitize, *paths], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path)
    lines = result.stdout.splitlines()
    started = [int(line.split()[1]) for line in lines if line.startswith("start ")]
    unexpected = [line for line in lines if line.startswith("unexpected ")]
    report = "\n".join(f"{line}  [{notes[int(line.split()[1])]}]" for line in unexpected)
    if result.returncode != 0:
        last = started[-1] if started else None
        pytest.fail(f"the loader crashed (status {result.returncode}) on case {last}: "
                    f"{notes[last] if last is not None else ''}\n{result.stderr[-3000:]}")
    assert not unexpected, f"exceptions other than our clean errors:\n{report}"
    assert len(started) == CASES
    # Some mutations still load (and so reach the C repack), or only the parser was fuzzed.
    assert sum(line.endswith(" loaded") for line in lines) >= CASES // 20
