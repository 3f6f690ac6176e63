"""Schemathesis against a real `conveyor serve`, as long as asked: every operation of its OpenAPI
document, positive and negative data, checked for no server error, response schema conformance
and negative data rejection. The suite runs the same with a fixed small example count
(tests/server/test_fuzz.py).

    python -m bench fuzz --model path/to/model --examples 2000 --seed 0
    python -m bench fuzz --url http://127.0.0.1:8000 --examples 500     # a server already running

Prints one line per operation and mode, and writes JSON (`report.save_run`) to --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance

from bench.report import save_run
from bench.serving.servers import free_port, launched

LOGS = Path(__file__).resolve().parents[1] / "results"
CHECKS = [not_a_server_error, response_schema_conformance, negative_data_rejection]


def fuzz_operation(operation, mode: GenerationMode, base_url: str, num_examples: int,  # type: ignore[no-untyped-def]
                   seed: int) -> tuple[int, str | None]:
    """(cases sent, the failure found or None)."""
    num_cases = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=num_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case) -> None:  # type: ignore[no-untyped-def]
        nonlocal num_cases
        num_cases += 1
        case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=120)

    try:
        hypothesis_seed(seed)(run)()
    except Exception as exc:  # a found failure: reported, and the other operations still run
        return num_cases, str(exc)[:4000]
    return num_cases, None


@contextlib.contextmanager
def target(args: argparse.Namespace, stamp: str) -> Iterator[str]:
    if args.url:
        yield args.url.rstrip("/")
        return
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--threads", str(args.threads),
           "--kv-cache-memory", "256MiB", "--max-model-len", str(args.max_model_len), "--log-level", "WARNING"]
    if args.model:
        cmd += ["--model", args.model]
    with launched(cmd, port, LOGS / f"fuzz-{stamp}.log") as server:
        yield server.base_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model for `conveyor serve` (default: the bundled one)")
    parser.add_argument("--url", default=None, help="fuzz this running server instead of starting one")
    parser.add_argument("--examples", type=int, default=1000, help="per operation and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=64, help="keeps every accepted request short")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    args = parser.parse_args(argv)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    report: dict = {"runs": []}
    started = time.perf_counter()
    with target(args, stamp) as base_url:
        schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                    continue  # no parameters, so nothing can violate the schema
                num_cases, failure = fuzz_operation(operation, mode, base_url, args.examples, args.seed)
                report["runs"].append({"operation": operation.label, "mode": mode.value, "cases": num_cases,
                                       "failure": failure})
                print(f"{operation.label:28} {mode.value:8} {num_cases:6} cases  "
                      f"{'FAILED' if failure else 'ok'}", flush=True)
                if failure:
                    print(failure, flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["num_failures"] = sum(run["failure"] is not None for run in report["runs"])
    print(f"{sum(r['cases'] for r in report['runs'])} cases in {report['seconds']} s, "
          f"{report['num_failures']} failures")
    save_run("fuzz", args.out_dir, report)
    return 0 if report["num_failures"] == 0 else 1
