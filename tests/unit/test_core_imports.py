"""conveyor.core stays pure Python: importing it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE_MODULES = ("conveyor.core.scheduler", "conveyor.core.block_manager", "conveyor.core.request",
                "conveyor.core.plan")


def test_core_imports_without_torch() -> None:
    code = "\n".join([
        "import sys",
        *(f"import {name}" for name in CORE_MODULES),
        "print(','.join(m for m in ('torch', 'numpy', 'transformers', 'tokenizers') if m in sys.modules))",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.strip()
    assert "torch" not in loaded.split(","), f"importing conveyor.core loaded: {loaded}"
