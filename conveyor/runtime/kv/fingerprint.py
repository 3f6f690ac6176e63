"""What a KV block on disk depends on: the model's bytes and everything that shapes or rounds its KV.

A block read back is used as if this engine had computed it, so its fingerprint covers the model
file's contents (a sha256 over every byte: a swapped file of the same name, size and mtime is
another model), the working and KV dtypes (an int8 block, with its scales, is a miss for a float16
server and the other way round), the quantization, the C kernels' instruction set (their
rounding differs), the device, the block layout and the model's KV shape.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

from conveyor.model.llama import ModelArch
from conveyor.private_cache import private_dir, read_private_file, write_atomically

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2   # of the block file and of the KV bytes in it (2: int8 blocks carry their scales)


def model_digest(model_path: Path, memo_root: Path) -> str:
    """sha256 over the model's files (a GGUF file, or a folder's plain files by name). Computed once
    per version of the files: remembered under `memo_root`, keyed by each file's inode, size, mtime
    and ctime (a rewrite or a replacement changes the ctime, which no user can set)."""
    files = [model_path] if model_path.is_file() else sorted(
        p for p in model_path.iterdir() if p.is_file() and not p.name.startswith("."))
    identity = hashlib.sha256()
    for path in files:
        info = path.stat()
        identity.update(f"{path.resolve()}\0{info.st_dev}\0{info.st_ino}\0{info.st_size}\0{info.st_mtime_ns}\0"
                        f"{info.st_ctime_ns}\n".encode("utf-8", "surrogatepass"))
    memo_dir = private_dir(memo_root / "digests", root=memo_root)
    memo = memo_dir / identity.hexdigest()[:40] if memo_dir is not None else None
    remembered = read_private_file(memo, 64) if memo is not None else None
    if remembered is not None and len(remembered) == 64 and all(c in b"0123456789abcdef" for c in remembered):
        return remembered.decode()
    started = time.perf_counter()
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode("utf-8", "surrogatepass") + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    result = digest.hexdigest()
    logger.info("start-up: model digest for the prefix cache dir in %.2f s (remembered for later starts)",
                time.perf_counter() - started)
    if memo is not None:
        try:
            write_atomically(memo, result.encode())
        except OSError as exc:
            logger.warning("could not remember the model digest: %s", exc)
    return result


def kv_fingerprint(digest: str, arch: ModelArch, *, dtype: torch.dtype, kv_dtype: torch.dtype, quantization: str,
                   kernel_features: frozenset[str] | None, device: torch.device, block_size: int,
                   transposed_keys: bool, tensor_parallel_size: int) -> bytes:
    """32 bytes that differ whenever a block's KV bytes could."""
    facts = {
        "layout_version": LAYOUT_VERSION, "model_sha256": digest, "dtype": str(dtype), "kv_dtype": str(kv_dtype),
        "quantization": quantization, "kernels": sorted(kernel_features) if kernel_features is not None else None,
        "device": device.type, "block_size": block_size, "transposed_keys": transposed_keys,
        "num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "tensor_parallel_size": tensor_parallel_size, "byte_order": sys.byteorder,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).digest()
