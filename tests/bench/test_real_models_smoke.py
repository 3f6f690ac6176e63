"""`python -m bench.real_models` end to end on the bundled model with tiny sizes: conveyor always,
llama-server too where scripts/build_llama_cpp.sh has built it (its part skips cleanly otherwise).

No timed assertions: every figure present and sane, the memory criterion computed, the JSON naming
its command and machine. Also the peak-RSS sampler on a process tree of known size.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import servers
from bench.real_models import QUICK, Sizes, compare, parse_sizes

REPO = Path(__file__).resolve().parents[2]
TINY = {"first_start": 0, "decode_requests": 1, "decode_tokens": 4, "prompt_tokens": 32, "prompt_repeats": 1,
        "batch_requests": 2, "batch_min_prompt": 10, "batch_max_prompt": 20, "batch_tokens": 4,
        "llama_parallel": "2", "greedy_prompts": 2, "greedy_tokens": 4}
LLAMA = servers.LlamaCpp.find(servers.DEFAULT_PEERS_DIR)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    from conveyor.model.checkpoint import default_model_path

    out_dir = tmp_path_factory.mktemp("real_models")
    systems = "conveyor,llama-server" if LLAMA is not None else "conveyor"
    cmd = [sys.executable, "-m", "bench.real_models", "--model", str(default_model_path()), "--systems", systems,
           "--threads", "1", "--conveyor-kv-cache-memory", "64MiB", "--out-dir", str(out_dir),
           "--log-dir", str(out_dir / "logs")]
    for name, value in TINY.items():
        cmd += ["--set", f"{name}={value}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out_dir.glob("real-models-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), proc.stdout, out_dir


def check_system(fig: dict, file_bytes: int, kv_gib: float | None) -> None:
    assert "skipped" not in fig, fig.get("skipped")
    assert fig["load_first_s"] is None   # first_start=0: the warm start only
    for key in ("load_warm_s", "decode_tok_s", "prompt_ttft_ms", "prompt_tok_s",
                "batch_output_tok_s"):
        assert fig[key] > 0, key
    assert fig["batch"]["failed"] == 0 and fig["batch"]["output_tokens"] == 2 * 4
    assert fig["peak_rss_gib"] * 2**30 > file_bytes / 2   # the weights are in memory
    assert all(launch["memory_samples"] > 0 for launch in fig["launches"])
    if kv_gib is not None:
        assert fig["kv_cache_gib"] == pytest.approx(kv_gib)
    assert fig["memory_budget_gib"] == pytest.approx((file_bytes + fig["kv_cache_gib"] * 2**30) / 2**30 + 1)
    assert fig["memory_within_budget"] in (True, False)
    assert len(fig["greedy_texts"]) == 2 and all(fig["greedy_texts"])


def test_conveyor_figures(bench_run: tuple[dict, str, Path]) -> None:
    doc, stdout, _ = bench_run
    assert doc["command"].startswith("python -m bench.real_models --model ")
    assert doc["machine"]["lscpu"] and doc["versions"]["conveyor"]
    [(name, result)] = doc["results"].items()
    assert name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    conveyor = result["systems"]["conveyor"]
    check_system(conveyor, result["file_bytes"], 64 / 1024)
    assert [launch["label"] for launch in conveyor["launches"]] == ["warm"]
    processes = conveyor["launches"][0]["process_peak_rss_bytes"]
    assert "server" in processes and len(processes) >= 2   # the engine core is a child process
    assert "peak RSS within file + KV + 1 GiB" in stdout


def test_llama_server_figures(bench_run: tuple[dict, str, Path]) -> None:
    if LLAMA is None:
        pytest.skip(f"llama-server not built: {servers.BUILD_HINT}")
    doc, stdout, out_dir = bench_run
    [result] = doc["results"].values()
    llama = result["systems"]["llama-server"]
    check_system(llama, result["file_bytes"], None)
    assert [launch["label"] for launch in llama["launches"]] == ["warm", "np2"]
    assert llama["batch"]["best_parallel"] == 2
    assert all(ratio > 0 for key, ratio in result["comparison"]["ratios"].items() if key != "load_first_s")
    assert result["comparison"]["greedy_agreement"]["prompts"] == 2
    pngs = list(out_dir.glob("real-models-*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 0 and "greedy text" in stdout


def test_sizes_and_ratios() -> None:
    assert parse_sizes(False, []) == Sizes()
    assert parse_sizes(True, ["llama_parallel=4,16", "decode_tokens=8"]) == \
        dataclasses.replace(QUICK, llama_parallel=(4, 16), decode_tokens=8)
    with pytest.raises(SystemExit):
        parse_sizes(False, ["nope=1"])
    out = compare({"conveyor": {"decode_tok_s": 30.0, "greedy_texts": ["a", "b"]},
                   "llama-server": {"decode_tok_s": 20.0, "load_warm_s": 1.0, "greedy_texts": ["a", "c"]}})
    assert out["ratios"]["decode_tok_s"] == pytest.approx(1.5) and out["ratios"]["load_warm_s"] is None
    assert out["greedy_agreement"] == {"identical": 1, "prompts": 2, "per_prompt": [True, False]}


def test_peak_rss_sums_children(tmp_path: Path) -> None:
    """A parent whose child holds 200 MB: the tree's peak counts the child's memory."""
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; b = bytearray(200 * 2**20); time.sleep(1.5)'])")
    process = subprocess.Popen([sys.executable, "-c", code])
    sampler = servers.PeakRss(process.pid, 0.05).start()
    process.wait(30)
    sampler.stop()
    assert sampler.num_samples > 5 and sampler.peak_bytes > 200 * 2**20
