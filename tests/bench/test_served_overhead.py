"""bench.serving.served_overhead end to end on the tiny checkpoint: offline and a real `conveyor serve`, every figure
present and every requested token produced. No timed assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_served_and_offline_figures(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "served-overhead", "--model", str(tiny_checkpoint), "--concurrency", "1,3",
           "--tokens", "6", "--prompt-tokens", "5", "--kv-cache-memory", "32MiB",
           "--out-dir", str(tmp_path), "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result_file] = tmp_path.glob("served-overhead-*.json")
    record = json.loads(result_file.read_text())
    assert record["command"].startswith("python -m bench served-overhead")
    for n in ("1", "3"):
        figures = record["results"][n]
        assert figures["offline"]["tok_s"] > 0 and figures["offline"]["cpu_us_per_token"] > 0
        runs = figures["served"]
        assert set(runs) == ({"stream"} if n == "1" else {"stream", "non_stream"})
        for run in runs.values():
            assert run["produced"] == int(n) * 6 and run["tok_s"] > 0
            assert run["front_cpu_us_per_token"] >= 0 and run["core_cpu_us_per_token"] >= 0   # 10 ms clock ticks
        assert figures["served_over_offline"] > 0


@pytest.mark.slow
def test_the_tiny_model_has_the_bundled_tokenizer(tmp_path: Path) -> None:
    from conveyor.model.checkpoint import default_model_path
    from conveyor.text.tokenizer_loader import load_tokenizer

    from bench.serving.served_overhead import tiny_model

    try:
        bundled = default_model_path()
    except Exception as exc:   # the bundled model is an install step of its own
        pytest.skip(str(exc))
    path = tiny_model(tmp_path)
    assert path.stat().st_size < 20 * 2**20
    tiny, real = load_tokenizer(path), load_tokenizer(bundled)
    text = "The capital of France is Paris."
    assert tiny.vocab_size == real.vocab_size and tiny.encode(text) == real.encode(text)
    assert tiny_model(tmp_path) == path   # written once
