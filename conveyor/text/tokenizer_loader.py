"""A checkpoint's files -> `Tokenizer`: a GGUF file (gguf_vocab.py reads its metadata) or a Hugging Face
tokenizer folder (read here), with an optional chat template in place of the checkpoint's."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from conveyor.text.chat_template import pick_chat_template, read_chat_template
from conveyor.text.gguf_vocab import tokenizer_from_gguf
from conveyor.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint: a GGUF file's metadata, or a Hugging Face folder's files.

    `chat_template` (a Jinja file or the template text) replaces the checkpoint's; it is compiled
    here, so a template that does not parse stops the start-up with a ValueError naming it.
    """
    started = time.perf_counter()
    tokenizer = tokenizer_from_gguf(model_path) if model_path.is_file() else tokenizer_from_hf_folder(model_path)
    if chat_template is not None:
        tokenizer.use_chat_template(read_chat_template(chat_template))
    logger.info("tokenizer of %s loaded in %.2f s (%d tokens)", model_path.name, time.perf_counter() - started,
                tokenizer.vocab_size)
    return tokenizer


def tokenizer_from_hf_folder(folder: str | Path) -> Tokenizer:
    """Load `tokenizer.json`, `tokenizer_config.json`, the chat template files and `generation_config.json`."""
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}; a Hugging Face tokenizer folder needs one")
    backend = BackendTokenizer.from_file(str(tokenizer_file))
    config_file = folder / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}

    bos_token = _special_token_content(config.get("bos_token"))
    eos_token = _special_token_content(config.get("eos_token"))

    # Precedence as in transformers: chat_template.jinja, then chat_template.json, then the config.
    chat_template = pick_chat_template(config.get("chat_template"))
    if (folder / "chat_template.jinja").is_file():
        chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        chat_template = pick_chat_template(_read_json(folder / "chat_template.json").get("chat_template"))

    eos_ids: list[int] = []
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        eos = _read_json(generation_file).get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else [int(i) for i in eos or []]

    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: follow what tokenizer.json's own post-processor would add.
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    return Tokenizer(
        backend,
        bos_token=bos_token,
        eos_token=eos_token,
        eos_token_ids=eos_ids,
        add_bos=bool(add_bos),
        chat_template=chat_template,
    )


def _special_token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as serialized AddedToken dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry in tokenizer_config.json: {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data
