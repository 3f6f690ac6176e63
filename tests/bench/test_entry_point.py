"""`python -m bench NAME`: one entry point that lists and reaches every benchmark, each under its short name."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHMARKS, main

REPO = Path(__file__).resolve().parents[2]


def modules_with_main() -> set[str]:
    """Every bench module that defines a top-level main(): a benchmark the entry point must reach."""
    found = set()
    for path in (REPO / "bench").rglob("*.py"):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_every_benchmark_has_a_name_and_every_name_a_benchmark() -> None:
    assert {module for module, _ in BENCHMARKS.values()} == modules_with_main()


def test_no_benchmark_module_is_launched_another_way() -> None:
    guarded = [str(path.relative_to(REPO)) for path in (REPO / "bench").rglob("*.py")
               if path.name != "__main__.py" and '__name__ == "__main__"' in path.read_text()]
    assert not guarded


def test_no_bench_package_holds_more_than_12_modules() -> None:
    for package in [REPO / "bench", *(p for p in (REPO / "bench").iterdir() if (p / "__init__.py").exists())]:
        assert len(list(package.glob("*.py"))) <= 12, package


def test_help_lists_every_benchmark_with_its_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, (_, line) in BENCHMARKS.items():
        assert any(row.split()[:1] == [name] and row.rstrip().endswith(line) for row in lines), name


def test_an_unknown_name_is_refused_with_the_names() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no benchmark named 'nope'" in proc.stderr and "real-models" in proc.stderr


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_parses_its_own_flags_under_its_name(name: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert out.getvalue().startswith(f"usage: python -m bench {name} ")
    assert "--out-dir" in out.getvalue()   # every benchmark writes its JSON there, docs/bench by default


def test_a_run_is_recorded_as_every_run_is(tmp_path: Path) -> None:
    """The command that reproduces it, the machine and the versions first, then the benchmark's own fields."""
    proc = subprocess.run([sys.executable, "-m", "bench", "scheduler-host", "--rows", "2", "--context", "20",
                           "--steps", "3", "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = tmp_path.glob("scheduler-host-*.json")
    record = json.loads(path.read_text())
    assert list(record)[:3] == ["command", "machine", "versions"]
    assert record["command"] == f"python -m bench scheduler-host --rows 2 --context 20 --steps 3 --out-dir {tmp_path}"
    assert record["machine"]["logical_cpus"] and "torch" in record["versions"]
    [row] = record["results"]
    assert row["rows"] == 2 and row["context"] == 20 and row["schedule_ms"] > 0 and row["update_ms"] > 0
