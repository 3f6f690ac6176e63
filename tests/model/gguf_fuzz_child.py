"""Loads each GGUF file named on the command line (model and tokenizer), one line per file on stdout:
`start I` before, then `clean I loaded` or `clean I error` (our clean error) or `unexpected I TYPE: MESSAGE`. Run in a
child process by test_gguf_fuzz.py, so that a crash ends this process, not the test run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from conveyor import kernels
from conveyor.errors import ConveyorError, ModelLoadError
from conveyor.model.loader import load_model


def _check(path: Path, lib: kernels.KernelLibrary | None) -> str:
    """"loaded" or "error" (a clean one) for the model; the tokenizer is read too."""
    from conveyor.text.gguf_vocab import tokenizer_from_gguf

    outcome = "loaded"
    try:
        model = load_model(path, torch.float32, kernel_library=lib, quantization="gguf" if lib else "none")
        ids = torch.arange(min(4, model.arch.vocab_size))
        model.embed_tokens(ids)   # a kept embedding reads its rows from the file
    except ModelLoadError:
        outcome = "error"
    try:
        tokenizer_from_gguf(path, merges_cache=None)
    except (ValueError, ConveyorError):   # what the CLI reports as an error
        pass
    return outcome


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--sanitize":
        kernels.use_sanitizers()
        argv = argv[1:]
    lib = kernels.library()
    for i, name in enumerate(argv):
        print(f"start {i}", flush=True)
        try:
            outcome = _check(Path(name), lib)
        except Exception as exc:  # noqa: BLE001 - any other type is what the test reports
            print(f"unexpected {i} {type(exc).__name__}: {str(exc)[:300]!r}", flush=True)
            continue
        print(f"clean {i} {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
