"""Named prompts in the prefix cache's folder: a prompt's token ids kept under a name, its blocks pinned.

    FOLDER/named/<name>.json    {"version": 1, "token_ids": [...], "blocks": ["<hash>.kv", ...]}

llama-server's `/slots/{id}?action=save|restore|erase` maps here (server/prompt_cache/slots.py). Saving names the
leading blocks of a prompt that are on disk (the disk tier writes every cached block) and keeps them
from the size bound's trimming; restoring reads the name back and checks its blocks are still there,
so the next prompt that starts with those tokens reads them from disk instead of computing them.
No torch here: the API process uses it, the core's writer reads the pins.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from conveyor.core.block_manager import hash_block
from conveyor.errors import InvalidRequest, NotFound
from conveyor.private_cache import private_dir, read_private_file, write_atomically

BLOCK_SUFFIX = ".kv"
_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}")
_MAX_MANIFEST_BYTES = 16 * 2**20


def block_file_name(block_hash: bytes) -> str:
    return f"{block_hash.hex()}{BLOCK_SUFFIX}"


def check_name(name: object, param: str = "filename") -> str:
    """A name usable as one file name: letters, digits, '_', '-', '.', not leading, no '..'; else a 400."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidRequest(f"{param} must be 1 to 128 letters, digits, '_', '-' or '.', with no path separator, "
                             "no leading '.' and no '..'", param=param)
    return name


def _manifest_path(folder: Path, name: str) -> Path:
    return folder / "named" / f"{check_name(name)}.json"


def _block_names(token_ids: list[int], block_size: int) -> list[str]:
    names, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        names.append(block_file_name(parent))
    return names


def _on_disk(folder: Path, names: list[str]) -> int:
    """How many of the leading block files exist."""
    count = 0
    for name in names:
        if not os.path.exists(folder / name):
            break
        count += 1
    return count


def save(folder: Path, name: str, token_ids: list[int], block_size: int, wait_s: float = 3.0) -> int:
    """Name the prompt's leading blocks on disk; returns the tokens they hold. Blocks still queued for
    the disk are waited for up to `wait_s`."""
    names = _block_names(token_ids, block_size)
    deadline = time.monotonic() + wait_s
    while (found := _on_disk(folder, names)) < len(names) and time.monotonic() < deadline:
        time.sleep(0.05)
    named = private_dir(folder / "named", root=folder)
    if named is None:
        raise InvalidRequest("the prefix cache folder cannot hold named prompts (not private to this user)")
    document = {"version": 1, "token_ids": token_ids, "blocks": names[:found]}
    write_atomically(_manifest_path(folder, name), json.dumps(document).encode())
    return found * block_size


def restore(folder: Path, name: str, block_size: int) -> tuple[list[int], int]:
    """(the named prompt's token ids, how many of its leading tokens are on disk); 404 for an unknown name."""
    document = _read(_manifest_path(folder, name))
    if document is None:
        raise NotFound(f"no named prompt {name!r} in the prefix cache", param="filename")
    token_ids = document["token_ids"]
    return token_ids, _on_disk(folder, _block_names(token_ids, block_size)) * block_size


def erase(folder: Path, name: str) -> bool:
    try:
        os.unlink(_manifest_path(folder, name))
        return True
    except FileNotFoundError:
        return False


def pinned_files(folder: Path) -> frozenset[str]:
    """The block files some name keeps; an unreadable name keeps none."""
    pinned: set[str] = set()
    for path in (folder / "named").glob("*.json"):
        document = _read(path)
        if document is not None:
            pinned.update(document["blocks"])
    return frozenset(pinned)


def _read(path: Path) -> dict | None:
    """A manifest, checked: a private file of valid JSON with int token ids and block file names."""
    data = read_private_file(path, _MAX_MANIFEST_BYTES)
    if data is None:
        return None
    try:
        document = json.loads(data)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("version") != 1:
        return None
    token_ids, blocks = document.get("token_ids"), document.get("blocks")
    if not (isinstance(token_ids, list) and all(type(t) is int and 0 <= t < 2**31 for t in token_ids)
            and isinstance(blocks, list) and all(isinstance(b, str) and re.fullmatch(r"[0-9a-f]{64}\.kv", b)
                                                 for b in blocks)):
        return None
    return document
