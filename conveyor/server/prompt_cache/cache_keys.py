"""A request's own cache key, as QVAC's completions name one (`cacheKey`, `saveCacheToDisk`), over the
named-prompt store that /slots save/restore use (runtime/kv/named_prompts.py; needs --prefix-cache-dir).

- `cache_key` (or `cacheKey`): the name of this conversation's prompt prefix. When a name of that
  key is saved, it is restored before the request starts: its blocks are checked on disk and the
  prompt's leading tokens that match them are read back instead of computed (the disk tier finds them
  by their chained hashes, after a restart too).
- `save_cache_to_disk` (or `saveCacheToDisk`): when the request ends, its prompt's full blocks are
  named under the key and kept from the disk's size bound, so a later request (or a later server on
  the same folder) with the key starts from them. Saving again under a key replaces what it named.

A key is one file name (letters, digits, '_', '-', '.', at most 128, no '..'): anything else is a 400.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from conveyor.front.async_engine import AsyncEngine
from conveyor.errors import InvalidRequest, NotFound
from conveyor.runtime.kv import named_prompts
from conveyor.server.openai_api.sampling_request import SamplingRequest
from conveyor.server.openai_api.prompt_group import PromptGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheKey:
    name: str
    save: bool
    folder: Path
    block_size: int


def cache_key_of(body: SamplingRequest, engine: AsyncEngine, num_prompts: int) -> CacheKey | None:
    """The request's key, checked (400s name the field); None when it names none."""
    if body.cache_key is None:
        if body.save_cache_to_disk:
            raise InvalidRequest("save_cache_to_disk needs a cache_key to save under", param="save_cache_to_disk")
        return None
    name = named_prompts.check_name(body.cache_key, param="cache_key")
    if not engine.info.prefix_cache_folder:
        raise InvalidRequest("cache_key needs a prefix cache on disk: start the server with --prefix-cache-dir",
                             param="cache_key")
    if num_prompts != 1 or body.n != 1:
        raise InvalidRequest("a cache_key names one prompt's prefix: send one prompt with n 1", param="cache_key")
    return CacheKey(name, body.save_cache_to_disk, Path(engine.info.prefix_cache_folder), engine.info.block_size)


async def prepare(body: SamplingRequest, engine: AsyncEngine, prompts: list[list[int]]) -> CacheKey | None:
    """The request's key, checked, with what it saved restored first; None when it names none."""
    key = cache_key_of(body, engine, len(prompts))
    if key is not None:
        await restore(key, prompts[0])
    return key


async def restore(key: CacheKey, prompt: list[int]) -> int:
    """How many of the prompt's leading tokens the key's saved blocks hold (0 for a key not saved yet)."""
    try:
        named, on_disk = await asyncio.to_thread(named_prompts.restore, key.folder, key.name, key.block_size)
    except NotFound:
        return 0
    same = next((i for i, (a, b) in enumerate(zip(named, prompt)) if a != b), min(len(named), len(prompt)))
    restored = min(same, on_disk) // key.block_size * key.block_size
    logger.info("cache_key %s: %d of the prompt's %d tokens restored from disk", key.name, restored, len(prompt))
    return restored


_saving: set[asyncio.Task[None]] = set()   # the tasks are kept until they end


def save_when_done(key: CacheKey, group: PromptGroup, prompt: list[int]) -> None:
    """Name the prompt's blocks under the key once its request has ended (not when it was aborted)."""
    async def save() -> None:
        if not await group.wait_first_choices():
            return
        try:
            num_tokens = await asyncio.to_thread(named_prompts.save, key.folder, key.name, prompt, key.block_size)
        except (InvalidRequest, OSError) as exc:
            logger.warning("cache_key %s: not saved: %s", key.name, exc)
            return
        logger.info("cache_key %s: %d tokens saved", key.name, num_tokens)

    task = asyncio.create_task(save(), name=f"save-cache-key-{key.name}")
    _saving.add(task)
    task.add_done_callback(_saving.discard)
