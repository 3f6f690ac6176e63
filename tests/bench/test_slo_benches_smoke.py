"""`python -m bench capacity` and `python -m bench interference` end to end on the bundled model with
tiny sizes, conveyor only (llama-server is not built in CI). No timed assertions: the figures exist,
are consistent with each other, and the JSON and plot are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving.capacity import capacity_of

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], out_dir: Path, pattern: str) -> dict:
    cmd = [sys.executable, "-m", "bench", *args, "--systems", "conveyor", "--threads", "1",
           "--out-dir", str(out_dir), "--log-dir", str(out_dir / "logs")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out_dir.glob(pattern))
    assert len(files) == 1, files
    assert files[0].with_suffix(".png").is_file()
    document = json.loads(files[0].read_text())
    assert document["command"].startswith("python -m bench ") and document["machine"]["logical_cpus"]
    return document


def test_capacity_climbs_the_ladder_and_reports_attainment(tmp_path: Path) -> None:
    document = _run(["capacity", "--rates", "1,4", "--rung-s", "3", "--refine", "0", "--min-requests", "4",
                     "--min-prompt", "8", "--max-prompt", "16", "--output-tokens", "4", "--tpot-ms", "60000",
                     "--ttft-ms", "60000"], tmp_path, "capacity-*.json")
    rungs = document["results"]["conveyor"]["conveyor"]["rungs"]
    assert [r["rate_req_s"] for r in rungs] == [1.0, 4.0]
    assert [r["num_requests"] for r in rungs] == [4, 12]   # max(--min-requests, rate x --rung-s)
    for rung in rungs:
        assert rung["failed"] == 0 and rung["output_tokens"] == 4 * rung["num_requests"]
        assert rung["attainment"] == 1.0 and rung["meets_slo"]   # a 60 s SLO: everything meets it
        assert rung["ttft_ms"]["p99"] >= rung["ttft_ms"]["p50"] > 0
    assert document["summary"]["conveyor"]["capacity_req_s"] == 4.0


def test_capacity_of_a_mixed_workload_reports_each_class(tmp_path: Path) -> None:
    # A 1 ms TTFT target for documents: no document meets it, every chat meets its 60 s one.
    document = _run(["capacity", "--rates", "2", "--rung-s", "4", "--refine", "0", "--min-requests", "8",
                     "--min-prompt", "8", "--max-prompt", "16", "--output-tokens", "4", "--tpot-ms", "60000",
                     "--ttft-ms", "60000", "--documents", "0.5", "--doc-min-prompt", "100", "--doc-max-prompt",
                     "200", "--doc-ttft-ms", "1"], tmp_path, "capacity-*.json")
    (rung,) = document["results"]["conveyor"]["conveyor"]["rungs"]
    chat, docs = rung["classes"]["chat"], rung["classes"]["document"]
    assert chat["num_requests"] + docs["num_requests"] == rung["num_requests"] == 8
    assert chat["num_requests"] and docs["num_requests"] and rung["failed"] == 0
    assert chat["meets_slo"] and docs["attainment"] == 0.0 and not rung["meets_slo"]
    assert docs["prompt_tokens"] / docs["num_requests"] >= 100 > 16 >= chat["prompt_tokens"] / chat["num_requests"]
    assert document["summary"]["conveyor"]["capacity_by_class_req_s"] == {"chat": 2.0, "document": 0.0}
    assert document["summary"]["conveyor"]["capacity_req_s"] == 0.0


def test_capacity_is_the_highest_rung_that_met_the_slo() -> None:
    rungs = [{"rate_req_s": 0.5, "meets_slo": True}, {"rate_req_s": 1.0, "meets_slo": False},
             {"rate_req_s": 1.4, "meets_slo": True}, {"rate_req_s": 2.0, "meets_slo": False}]
    assert capacity_of(rungs) == 1.4
    assert capacity_of([{"rate_req_s": 0.5, "meets_slo": False}]) == 0.0


@pytest.mark.parametrize("streams", [2])
def test_interference_splits_the_gaps_at_the_long_prompt(tmp_path: Path, streams: int) -> None:
    document = _run(["interference", "--streams", str(streams), "--stream-prompt", "8", "--stream-tokens", "400",
                     "--long-prompt", "512", "--before-s", "0.5", "--after-s", "0.1"], tmp_path,
                    "interference-*.json")
    fig = document["results"]["conveyor"]
    assert fig["num_gaps_before"] > 0 and fig["num_gaps_during"] > 0
    assert fig["long_prompt_ttft_ms"] > 0
    start, end = fig["window_s"]
    assert 0 < start < end
    assert fig["p99_ratio"] == pytest.approx(fig["itl_during_ms"]["p99"] / fig["itl_before_ms"]["p99"])
    # The control streamed the same requests alone, past the token positions of the window.
    assert fig["num_gaps_control"] == fig["num_gaps_during"]
    assert fig["p99_ratio_to_control"] == pytest.approx(fig["itl_during_ms"]["p99"]
                                                        / fig["itl_control_same_tokens_ms"]["p99"])


def test_head_of_line_times_the_short_request_and_the_long_prompt_alone_and_not(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench", "head-of-line", "--threads", "1", "--long-prompt", "96",
           "--short-prompt", "4", "--short-tokens", "2", "--delay-s", "0.05", "--out-dir", str(tmp_path),
           "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("head-of-line-*.json")
    document = json.loads(path.read_text())
    assert document["command"].startswith("python -m bench head-of-line")
    assert document["short_ttft_s"] > 0 and document["long_ttft_alone_s"] > 0
    assert document["long_ttft_ratio"] == pytest.approx(document["long_ttft_with_short_s"]
                                                        / document["long_ttft_alone_s"])
