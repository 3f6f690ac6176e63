"""`python -m bench flex-attention` end to end on the CPU with tiny sizes: both backends timed at each
context and the mixed one, their outputs agree, and the JSON names the command. No timed assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_flex_bench_times_both_backends_per_context(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "flex-attention", "--device", "cpu", "--dtype", "float32", "--rows", "3",
           "--contexts", "40,100", "--shape", "4,2,16,2", "--repeats", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("flex-attention-*.json")
    document = json.loads(path.read_text())
    assert document["command"].startswith("python -m bench flex-attention --device cpu")
    assert set(document["by_case"]) == {"40", "100", "mixed"}
    for fig in document["by_case"].values():
        assert fig["sdpa"]["attention_ms"] > 0 and fig["flex"]["attention_ms"] > 0
        assert fig["max_abs_diff"] < 1e-4
