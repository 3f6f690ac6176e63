"""`python -m bench real-models` end to end on the bundled model with tiny sizes: conveyor always, each
peer (llama-server, ik-llama, ik-llama-rtr) where it is built under the default peers dir, and skipped
with its reason where it is not.

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

from bench.peers.real_models import QUICK, SYSTEMS, Sizes, parse_sizes
from bench.peers.real_models_report import compare, plot, table
from bench.serving import servers

REPO = Path(__file__).resolve().parents[2]
TINY = {"first_start": 0, "decode_requests": 1, "decode_tokens": 4, "prompt_tokens": 32, "prompt_repeats": 1,
        "batch_requests": 2, "batch_min_prompt": 10, "batch_max_prompt": 20, "batch_tokens": 4,
        "llama_parallel": "2", "greedy_prompts": 2, "greedy_tokens": 4}
LLAMA = servers.LlamaCpp.find(servers.DEFAULT_PEERS_DIR)
IK = servers.IkLlama.find(servers.DEFAULT_PEERS_DIR / "ik")
BUILT = {"llama-server": LLAMA is not None, "ik-llama": IK is not None, "ik-llama-rtr": IK is not None}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    from conveyor.model.checkpoint import default_model_path

    out_dir = tmp_path_factory.mktemp("real_models")
    cmd = [sys.executable, "-m", "bench", "real-models", "--model", str(default_model_path()),
           "--systems", ",".join(SYSTEMS),
           "--threads", "1", "--conveyor-kv-cache-memory", "64MiB", "--out-dir", str(out_dir),
           "--log-dir", str(out_dir / "logs"), "--stream-bytes", str(64 << 20)]
    for name, value in TINY.items():
        cmd += ["--set", f"{name}={value}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240 + 150 * sum(BUILT.values()))
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
    assert doc["command"].startswith("python -m bench real-models --model ")
    assert doc["machine"]["lscpu"] and doc["versions"]["conveyor"]
    [(name, result)] = doc["results"].items()
    assert name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    conveyor = result["systems"]["conveyor"]
    check_system(conveyor, result["file_bytes"], 64 / 1024)
    # tied: the embedding is the output layer, read whole each step
    assert 0 < result["decode_bytes_per_token"] <= result["file_bytes"] and result["stream_read_bytes_per_s"] > 0
    assert conveyor["decode_share_of_stream"] == pytest.approx(
        conveyor["decode_tok_s"] * result["decode_bytes_per_token"] / result["stream_read_bytes_per_s"])
    assert "one-stream decode as a share of the C stream read" in stdout
    assert [launch["label"] for launch in conveyor["launches"]] == ["warm"]
    processes = conveyor["launches"][0]["process_peak_rss_bytes"]
    assert "server" in processes and len(processes) >= 2   # the engine core is a child process
    assert "peak RSS within file + KV + 1 GiB" in stdout


def test_peers_run_or_skip(bench_run: tuple[dict, str, Path]) -> None:
    """Every peer either ran (figures, its -np sweep, greedy agreement, a ratio) or names why it was skipped."""
    doc, stdout, out_dir = bench_run
    [result] = doc["results"].values()
    comparison = result["comparison"]
    for name, built in BUILT.items():
        fig = result["systems"][name]
        if not built:
            assert "not found" in fig["skipped"] and f"{name} skipped: " in stdout
            assert doc["peers"][name] == {"skipped": fig["skipped"]} and name not in comparison["ratios"]
            continue
        check_system(fig, result["file_bytes"], None)
        assert [launch["label"] for launch in fig["launches"]] == ["warm", "np2"]
        assert fig["batch"]["best_parallel"] == 2 and doc["peers"][name]["commit"]
        assert all(r > 0 for key, r in comparison["ratios"][name].items() if key != "load_first_s")
        assert comparison["greedy_agreement"][name]["prompts"] == 2
    if IK is not None:
        assert "-rtr" in result["systems"]["ik-llama-rtr"]["launches"][0]["command"].split()
        assert "-rtr" not in result["systems"]["ik-llama"]["launches"][0]["command"].split()
    pngs = list(out_dir.glob("real-models-*.png"))
    if any(BUILT.values()):
        assert comparison["best_peer"]["decode_tok_s"]["system"] in BUILT and "vs best peer" in stdout
        assert len(pngs) == 1 and pngs[0].stat().st_size > 0 and "greedy text" in stdout
    else:
        assert all(best is None for best in comparison["best_peer"].values()) and not pngs


def test_sizes() -> None:
    assert parse_sizes(False, []) == Sizes()
    assert parse_sizes(True, ["llama_parallel=4,16", "decode_tokens=8"]) == \
        dataclasses.replace(QUICK, llama_parallel=(4, 16), decode_tokens=8)
    with pytest.raises(SystemExit):
        parse_sizes(False, ["nope=1"])


THREE_PEERS = {
    "conveyor": {"decode_tok_s": 30.0, "load_warm_s": 2.0, "peak_rss_gib": 1.0, "prompt_ttft_ms": 100.0,
                 "greedy_texts": ["a", "b"], "batch": {"output_tok_s": 50.0}, "batch_output_tok_s": 50.0},
    "llama-server": {"decode_tok_s": 20.0, "load_warm_s": 1.0, "peak_rss_gib": 1.5, "prompt_ttft_ms": 200.0,
                     "greedy_texts": ["a", "c"], "batch": {"best_parallel": 8}, "batch_output_tok_s": 40.0},
    "ik-llama": {"decode_tok_s": 40.0, "load_warm_s": 4.0, "peak_rss_gib": 0.5, "prompt_ttft_ms": 80.0,
                 "greedy_texts": ["a", "b"], "batch": {"best_parallel": 16}, "batch_output_tok_s": 25.0},
    "ik-llama-rtr": {"skipped": "ik_llama.cpp's llama-server not found at /x/build/bin"},
}


def test_best_peer_per_metric() -> None:
    """Higher is better: the highest peer, conveyor / it; lower is better: the lowest, it / conveyor;
    a skipped peer takes no part."""
    out = compare(THREE_PEERS)
    best = out["best_peer"]
    assert best["decode_tok_s"] == {"system": "ik-llama", "value": 40.0, "ratio": pytest.approx(0.75)}
    assert best["batch_output_tok_s"] == {"system": "llama-server", "value": 40.0, "ratio": pytest.approx(1.25)}
    assert best["load_warm_s"] == {"system": "llama-server", "value": 1.0, "ratio": pytest.approx(0.5)}
    assert best["peak_rss_gib"] == {"system": "ik-llama", "value": 0.5, "ratio": pytest.approx(0.5)}
    assert best["prompt_ttft_ms"] == {"system": "ik-llama", "value": 80.0, "ratio": pytest.approx(0.8)}
    assert best["load_first_s"] is None and best["prompt_tok_s"] is None
    assert set(out["ratios"]) == {"llama-server", "ik-llama"}
    assert out["ratios"]["llama-server"]["decode_tok_s"] == pytest.approx(1.5)
    assert out["ratios"]["llama-server"]["prompt_ttft_ms"] == pytest.approx(2.0)   # half llama-server's TTFT
    assert out["greedy_agreement"] == {"llama-server": {"identical": 1, "prompts": 2, "per_prompt": [True, False]},
                                       "ik-llama": {"identical": 2, "prompts": 2, "per_prompt": [True, True]}}
    assert compare({"conveyor": {"decode_tok_s": 1.0}, "ik-llama": {"skipped": "absent"}})["best_peer"] == \
        {key: None for key in out["best_peer"]}


def test_table_and_plot(tmp_path: Path) -> None:
    text = table("m.gguf", 2**30, QUICK, THREE_PEERS, compare(THREE_PEERS))
    header = text.splitlines()[1].split()
    assert header == ["conveyor", "llama-server", "ik-llama", "vs", "best", "peer", "best", "peer"]
    decode = next(line for line in text.splitlines() if "decode, 1 stream" in line)
    assert "0.75x  ik-llama" in decode and "higher is better: conveyor / peer" in decode
    load = next(line for line in text.splitlines() if "load, warm start" in line)
    assert "0.50x  llama-server" in load and "lower is better: peer / conveyor" in load
    assert "best -np of 8: llama-server 8, ik-llama 16" in text
    assert "conveyor and ik-llama: identical on 2/2" in text
    assert "ik-llama-rtr skipped: ik_llama.cpp's llama-server not found" in text
    results = {"m.gguf": {"systems": THREE_PEERS}, "n.gguf": {"systems": THREE_PEERS}}
    png = plot(results, tmp_path / "p.png")
    assert png is None or Path(png).stat().st_size > 0   # None: matplotlib is not installed


def test_peak_rss_sums_children(tmp_path: Path) -> None:
    """A parent whose child holds 200 MB: the tree's peak counts the child's memory."""
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; b = bytearray(200 * 2**20); time.sleep(1.5)'])")
    process = subprocess.Popen([sys.executable, "-c", code])
    sampler = servers.PeakRss(process.pid, 0.05).start()
    process.wait(30)
    sampler.stop()
    assert sampler.num_samples > 5 and sampler.peak_bytes > 200 * 2**20
