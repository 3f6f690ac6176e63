"""llama-server's slot files, `POST /slots/{id_slot}?action=save|restore|erase`, over the prefix cache's
folder (--prefix-cache-dir; runtime/kv/named_prompts.py).

conveyor keeps no slots: requests share one prefix cache. Every slot id therefore names the last
prompt this server admitted, whichever request sent it:
- save {"filename": NAME}: names that prompt's leading full blocks (on disk already: the disk tier
  writes each cached block) and keeps them from the size bound's trimming, across restarts;
- restore {"filename": NAME}: reads the name back; the next prompt starting with its tokens reads
  them from disk instead of computing them (`n_restored`: the tokens still on disk). It also
  becomes the slot's last prompt, so a later save can name it again;
- erase: forgets the slot's last prompt; with {"filename": NAME}, the name too (its blocks become
  ordinary cache files). Blocks in memory stay: other requests may share them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from conveyor.front.async_engine import AsyncEngine
from conveyor.errors import InvalidRequest
from conveyor.runtime.kv import named_prompts


class SlotFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    filename: str | None = None


def add_slot_routes(app: FastAPI, engine: AsyncEngine, responses: dict[int | str, dict[str, Any]]) -> None:
    block_size = engine.info.block_size

    def folder() -> Path:
        if not engine.info.prefix_cache_folder:
            raise InvalidRequest("slot files need a prefix cache on disk: start the server with --prefix-cache-dir")
        return Path(engine.info.prefix_cache_folder)

    @app.post("/slots/{id_slot}", tags=["llama.cpp"], responses=responses)
    async def slot_action(id_slot: int, action: Literal["save", "restore", "erase"],
                          body: SlotFile | None = None) -> dict[str, Any]:
        """Save, restore or erase the last prompt's KV blocks under a file name (llama-server's slot files)."""
        if id_slot < 0:
            raise InvalidRequest(f"id_slot must be >= 0, got {id_slot}", param="id_slot")
        name = body.filename if body is not None else None
        if name is not None:
            named_prompts.check_name(name)
        elif action != "erase":
            raise InvalidRequest(f"action {action} needs a filename", param="filename")
        started = time.perf_counter()
        if action == "save":
            token_ids = engine.last_prompt_token_ids
            if token_ids is None:
                raise InvalidRequest("no prompt has been served yet: there is nothing to save")
            n_saved = await asyncio.to_thread(named_prompts.save, folder(), name, token_ids, block_size)
            return {"id_slot": id_slot, "filename": name, "n_saved": n_saved,
                    "timings": {"save_ms": 1000 * (time.perf_counter() - started)}}
        if action == "restore":
            token_ids, n_restored = await asyncio.to_thread(named_prompts.restore, folder(), name, block_size)
            engine.last_prompt_token_ids = token_ids
            return {"id_slot": id_slot, "filename": name, "n_restored": n_restored,
                    "timings": {"restore_ms": 1000 * (time.perf_counter() - started)}}
        n_erased = len(engine.last_prompt_token_ids or ())
        engine.last_prompt_token_ids = None
        if name is not None:
            await asyncio.to_thread(named_prompts.erase, folder(), name)
        return {"id_slot": id_slot, "n_erased": n_erased}
