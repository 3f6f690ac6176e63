"""The benchmark harness end to end on a tiny workload: the offline path and a real `conveyor serve`.

No timed assertions: every figure must be present and sane (positive, percentiles ordered, output
token counts equal to what was requested). Peers (transformers, llama.cpp) are not run here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving.client import RequestRecord, ServingRun
from bench.serving.metrics import percentile, summarize

REPO = Path(__file__).resolve().parents[2]
NUM_REQUESTS, OUTPUT_TOKENS = 4, 8
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def check_distribution(dist: dict) -> None:
    assert set(dist) == {"mean", "p50", "p90", "p99"}
    assert all(v > 0 for v in dist.values()), dist
    assert dist["p50"] <= dist["p90"] <= dist["p99"], dist


def check_throughput(fig: dict) -> None:
    assert fig["output_tokens"] == fig["output_tokens_requested"] == NUM_REQUESTS * OUTPUT_TOKENS
    assert fig["output_tokens_per_s"] > 0 and fig["requests_per_s"] > 0
    assert fig["total_tokens_per_s"] > fig["output_tokens_per_s"]
    assert fig["ratio_conveyor_to_this"] > 0


def check_serving(fig: dict) -> None:
    check_throughput(fig)
    assert fig["completed"] == NUM_REQUESTS and fig["failed"] == 0, fig["errors"]
    assert fig["usage_reported"] and fig["chunk_tokens"] == fig["output_tokens"]   # logprobs list every token
    for name in LATENCIES:
        if name == "itl_ms" and fig[name]["p50"] is None:
            continue   # every request's tokens came in one chunk (the front fell behind): no gap to measure
        check_distribution(fig[name])
    assert fig["ttft_ms"]["p99"] <= fig["e2e_ms"]["p99"]
    assert 0 <= fig["goodput"]["good_requests"] <= NUM_REQUESTS
    assert fig["goodput"]["requests_per_s"] <= fig["requests_per_s"]


@pytest.fixture(scope="module")
def bench_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out_dir = tmp_path_factory.mktemp("bench_results")
    cmd = [sys.executable, "-m", "bench", "run", "--systems", "conveyor,conveyor-server",
           "--model", str(tiny_checkpoint), "--num-requests", str(NUM_REQUESTS), "--output-tokens", str(OUTPUT_TOKENS),
           "--min-prompt", "10", "--max-prompt", "40", "--concurrency", "4", "--threads", "1",
           "--kv-cache-memory", "64MiB", "--single-requests", "1", "--logprobs",
           "--out-dir", str(out_dir), "--log-dir", str(out_dir / "logs")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out_dir.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), proc.stdout


def test_record_names_the_run(bench_run: tuple[dict, str]) -> None:
    doc, stdout = bench_run
    assert doc["command"].startswith("python -m bench run --systems conveyor,conveyor-server")
    assert doc["machine"]["cpu_model"] and doc["machine"]["usable_cpus"] >= 1
    assert doc["versions"]["torch"] and doc["versions"]["conveyor"]
    assert doc["workload"]["num_requests"] == NUM_REQUESTS
    assert all(10 <= n <= 40 for n in doc["workload"]["prompt_lengths"])
    assert "conveyor÷" in stdout and "goals:" in stdout


def test_offline_figures(bench_run: tuple[dict, str]) -> None:
    doc, _ = bench_run
    fig = doc["results"]["conveyor"]
    check_throughput(fig)
    assert fig["failed"] == 0 and fig["elapsed_s"] > 0
    assert fig["decode_steps"] and all(s["median_s"] > 0 for s in fig["decode_steps"].values())
    assert doc["single_request_decode"]["conveyor"]["decode_tokens_per_s"] > 0


def test_server_figures(bench_run: tuple[dict, str]) -> None:
    doc, _ = bench_run
    check_serving(doc["results"]["conveyor-server/c4"])
    samples = doc["samples"]["conveyor-server/c4"]
    assert len(samples["ttft_ms"]) == NUM_REQUESTS
    # One gap per pair of output chunks; a chunk carries several tokens when the server's front fell behind.
    assert len(samples["itl_ms"]) <= NUM_REQUESTS * (OUTPUT_TOKENS - 1)


def test_physical_limit(bench_run: tuple[dict, str]) -> None:
    lim = bench_run[0]["limits"]
    assert all(rate > 0 for rate in lim["matmul_flops_per_s"].values())
    assert {"1", "64", "256", "512"} <= set(lim["matmul_flops_per_s"])
    assert lim["bandwidth"]["used_bytes_per_s"] > 0 and lim["weight_bytes"] > 0
    assert all(f["floor_s"] > 0 for f in lim["decode_step_floor"].values())
    assert lim["conveyor_decode_steps"] and all(c["pct_of_floor"] > 0 for c in lim["conveyor_decode_steps"].values())
    floor = lim["workload_floor"]
    assert floor["total_s"] == pytest.approx(floor["prefill_s"] + floor["decode_s"]) and floor["total_s"] > 0


def test_goals_and_plots(bench_run: tuple[dict, str]) -> None:
    doc, _ = bench_run
    goals = {g["goal"]: g for g in doc["goals"]}
    assert goals["offline output tok/s vs best llama-server F32 -np"]["value"] == "not measured"
    assert goals["conveyor serve vs offline LLM.generate, same requests"]["met"] in (True, False)
    assert not any("Poisson" in name for name in goals)   # capacity under an SLO replaced it (bench capacity)
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in doc["plots"]
    else:
        # throughput and TTFT always; ITL where some request's tokens came in more than one chunk
        with_gaps = bool(doc["samples"]["conveyor-server/c4"]["itl_ms"])
        assert len(doc["plots"]) == 2 + with_gaps and all(Path(p).stat().st_size > 0 for p in doc["plots"])


def test_summarize_counts_and_orders() -> None:
    records = []
    for i in range(5):
        r = RequestRecord(prompt_tokens=10, max_tokens=3, ttft_s=0.1 * (i + 1), e2e_s=0.1 * (i + 1) + 0.2,
                          chunk_times_s=[1.0, 1.1, 1.2], chunk_tokens=3, usage_tokens=3)
        records.append(r)
    records.append(RequestRecord(prompt_tokens=10, max_tokens=3, error="HTTP 500"))
    fig = summarize(ServingRun(records, duration_s=2.0, rate=None, max_concurrency=None), 0.31, 1.0)
    assert fig["completed"] == 5 and fig["failed"] == 1 and fig["output_tokens"] == 15
    assert fig["goodput"]["good_requests"] == 3
    assert fig["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert fig["itl_ms"]["p50"] == pytest.approx(100.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_replay_times_every_request(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "replay", "--model", str(tiny_checkpoint), "--rate", "50",
           "--num-requests", "3", "--output-tokens", "4", "--min-prompt", "5", "--max-prompt", "20",
           "--threads", "1", "--target-itl-ms", "0", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = tmp_path.glob("replay-*.json")
    result = json.loads(record.read_text())
    assert result["command"].startswith("python -m bench replay --model")
    check_distribution(result["ttft_ms"])
    check_distribution(result["itl_ms"])
    assert result["options"]["target_itl_ms"] is None and result["max_ttft_ms"] >= result["ttft_ms"]["p99"]


def test_no_empty_plots(tmp_path: Path) -> None:
    """A run that measured no server writes no latency plots, and one that measured nothing none at all."""
    from bench.report import plots

    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    assert plots({}, {}, tmp_path) == []
    offline = {"conveyor/64": {"output_tokens_per_s": 200.0, "concurrency": 64}}
    assert [Path(p).name for p in plots(offline, {"conveyor/64": {}}, tmp_path)] == ["throughput_vs_concurrency.png"]


def test_model_file_is_the_llama_peer(tmp_path: Path) -> None:
    """With --model FILE.gguf every llama family is llama-server on that file, and conveyor keeps its own
    defaults; the bundled model and HF folders keep float32/none against the F32 peer."""
    import argparse

    from bench.peers.run import MODEL_PEER, peer_family, resolve_conveyor_options, selected_families

    gguf, folder = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    folder.mkdir()
    assert selected_families("conveyor,llama-server", str(gguf)) == ["conveyor", MODEL_PEER]
    assert MODEL_PEER not in selected_families("all")
    with pytest.raises(SystemExit):
        selected_families(MODEL_PEER)
    for model, expected in ((str(gguf), (None, None)), (str(folder), ("float32", "none")), (None, ("float32", "none"))):
        args = argparse.Namespace(model=model, conveyor_dtype=None, conveyor_quantization=None)
        resolve_conveyor_options(args)
        assert (args.conveyor_dtype, args.conveyor_quantization) == expected
    assert peer_family(argparse.Namespace(model=str(gguf), conveyor_quantization=None)) == MODEL_PEER
    assert peer_family(argparse.Namespace(model=str(folder), conveyor_quantization="none")) == "llama-server-f32"


IK_HELP = """usage: llama-server [options]
  -t,    --threads N                  number of threads to use during generation (default: 8)
  -tb,   --threads-batch N            number of threads to use during batch and prompt processing
  -cram, --cache-ram N                set the maximum cache size in MiB (default: 8192, -1 - no limit, 0 - disable)
  -cram-n-min N, --cache-ram-n-min N  minimum number of the cached tokens that triggers prompt cache
  -fa, --flash-attn (auto|on|off|0|1) set Flash Attention (default: on)
  -cb,   --cont-batching              enable continuous batching (a.k.a dynamic batching) (default: enabled)
  -rtr,   --run-time-repack           repack tensors if interleaved variant is available
         --fit-margin N               safety margin in MiB when auto-fitting model offloading
         --webui NAME                 which webui to serve
         --log-file FNAME             Specify a log filename (without extension)
"""


def test_ik_llama_command_from_help() -> None:
    """ik_llama's flags come from its --help as whole tokens: `--fit-margin` is no `-fit`, `--webui` no
    `--no-webui`; -rtr only in the repacking config, and refused by a build that lacks it."""
    from bench.serving.servers import IkLlama, help_flags

    assert {"-cram", "--cache-ram", "-cram-n-min", "-rtr", "--fit-margin"} <= help_flags(IK_HELP)
    assert "-fit" not in help_flags(IK_HELP) and "-zero" not in help_flags("non-zero")
    plain = IkLlama(Path("/ik/build/bin/llama-server"), Path("/ik"))
    assert plain.name == "ik-llama" and plain.commit() == "unknown"
    cmd = plain.command(8080, Path("m.gguf"), parallel=4, ctx_per_slot=100, threads=2, help_text=IK_HELP)
    assert cmd == ["/ik/build/bin/llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "8080",
                   "-np", "4", "-c", "400", "-t", "2", "-tb", "2", "-ngl", "0", "-cram", "0", "-cb"]
    rtr = IkLlama(plain.server, plain.src_dir, repack=True)
    assert rtr.name == "ik-llama-rtr"
    assert rtr.command(8080, Path("m.gguf"), parallel=1, ctx_per_slot=64, threads=2, help_text=IK_HELP,
                       trace_log=Path("/logs/m-trace"))[-3:] == ["--log-file", "/logs/m-trace", "-rtr"]
    older = "\n".join(line for line in IK_HELP.splitlines() if "-rtr" not in line and "-cram" not in line)
    assert "-cram" not in plain.command(8080, Path("m.gguf"), parallel=1, ctx_per_slot=64, threads=2, help_text=older)
    with pytest.raises(ValueError, match="-rtr"):
        rtr.command(8080, Path("m.gguf"), parallel=1, ctx_per_slot=64, threads=2, help_text=older)


def test_ik_llama_found_with_its_snapshot(tmp_path: Path) -> None:
    from bench.serving.servers import IkLlama

    assert IkLlama.find(tmp_path) is None
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-server").write_text("")
    (tmp_path / "SNAPSHOT").write_text("8337e4cd3861406fc04e0854b1409cd1b027fbc9 2026-08-15\n")
    found = IkLlama.find(tmp_path, repack=True)
    assert found is not None and found.repack
    assert found.commit() == "8337e4cd3861406fc04e0854b1409cd1b027fbc9 2026-08-15"
