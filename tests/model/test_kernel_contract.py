"""The C kernels' one contract (kernels.h): Python reads the format table the libraries are compiled
with, the table agrees with gguf's block sizes and with the file validator's scale offsets, the
compiler refuses a row that disagrees with the typed block structs, and the C sources include only
headers, at their top, with no two files needing each other."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import pytest

from conveyor import kernels
from conveyor.kernels import formats, quant
from conveyor.kernels.build import SOURCE_DIR, SOURCES, builds, compile_flags
from conveyor.model.gguf.validate import SCALE_FIELDS

NATIVE = kernels.cpu_features()
MAX_LINES = 400
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")


def test_every_build_was_compiled_with_the_table_python_reads() -> None:
    for name, features in builds(NATIVE).items():
        library = kernels.library_for(features)   # library_for runs formats.check
        formats.check(library.lib)
        assert [row[0] for row in formats.reported(library.lib)] == list(range(len(formats.FORMATS))), name


def test_a_table_out_of_step_with_the_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    q4_k = formats.FORMATS["q4_k"]
    monkeypatch.setitem(formats.FORMATS, "q4_k", dataclasses.replace(q4_k, header_bytes=q4_k.header_bytes + 64))
    with pytest.raises(RuntimeError, match="q4_k"):
        formats.check(kernels.library().lib)


def test_the_table_gives_gguf_block_sizes_and_the_validator_scale_offsets() -> None:
    offsets = formats.scale_offsets(kernels.library().lib)
    for fmt in formats.FORMATS.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt.gguf_type]] == (fmt.block_weights,
                                                                                    fmt.block_bytes), fmt.name
        assert SCALE_FIELDS[fmt.gguf_type] == (offsets[fmt.name], fmt.num_scales), fmt.name
    assert set(quant.FORMATS) == set(formats.FORMATS)
    assert [quant.BLOCK_BYTES[name] for name in quant.LEGACY] == [1088, 576, 640]   # quant.c's layout


@pytest.mark.parametrize("row,edit", [("Q4_K", (144, 146)), ("Q6_K", (576, 512)), ("Q5_0", (128, 0))])
def test_the_compiler_refuses_a_row_that_disagrees_with_its_structs(tmp_path: Path, row: str,
                                                                      edit: tuple[int, int]) -> None:
    for name in ("kernels.h", "half.h", "pool.h", "formats.c"):
        shutil.copy(SOURCE_DIR / name, tmp_path / name)
    header = tmp_path / "kernels.h"
    text = header.read_text()
    line = next(line for line in text.splitlines() if line.lstrip().startswith(f"X({row},"))
    edited = re.sub(rf"\b{edit[0]}\b", str(edit[1]), line, count=1)
    assert edited != line
    header.write_text(text.replace(line, edited))
    compiler = shutil.which("cc") or shutil.which("gcc")
    result = subprocess.run([compiler, "-fsyntax-only", str(tmp_path / "formats.c")], capture_output=True, text=True)
    assert result.returncode != 0 and row.lower() in result.stderr


def _includes(path: Path) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(path.read_text().splitlines())
            if (m := re.match(r'\s*#\s*include\s+"([^"]+)"', line))]


def test_sources_include_only_headers_at_their_top_and_stay_short() -> None:
    for path in sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]):
        lines = path.read_text().splitlines()
        assert len(lines) <= MAX_LINES, path.name
        first_code = next(i for i, line in enumerate(lines)
                          if line.strip() and not line.lstrip().startswith(("#", "/*", "*")))
        for i, name in _includes(path):
            assert name.endswith(".h") and i < first_code, f"{path.name}:{i + 1} includes {name}"
        if path.suffix == ".h":   # a header, not a fragment: guarded, so it can be included anywhere once
            assert re.search(r"#ifndef (\w+)\n#define \1\n", path.read_text()), path.name
    missing = [p.name for p in SOURCE_DIR.glob("*.c") if "kernels.h" not in dict(_includes(p)).values()]
    assert missing == []


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    out = subprocess.run(["nm", "-P", str(obj)], capture_output=True, text=True, check=True).stdout
    rows = [line.split()[:2] for line in out.splitlines()]
    return {n for n, t in rows if t in "TDBR"}, {n for n, t in rows if t == "U"}


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm")
def test_no_two_sources_need_each_other(tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = [f for f in compile_flags(frozenset()) if f not in ("-shared", "-O3")]

    def compiled(name: str) -> tuple[set[str], set[str]]:
        obj = tmp_path / f"{name}.o"
        subprocess.run([compiler, *flags, "-O0", "-c", "-o", str(obj), str(SOURCE_DIR / name)], check=True)
        return _symbols(obj)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        symbols = dict(zip(SOURCES, pool.map(compiled, SOURCES)))   # name -> (defined, needed)
    owner = {symbol: name for name, (defined, _) in symbols.items() for symbol in defined}
    uses = {name: {owner[s] for s in needed if s in owner} - {name} for name, (_, needed) in symbols.items()}
    order: list[str] = []   # a topological order exists only if no files need each other, however far round
    while len(order) < len(SOURCES):
        ready = [name for name in SOURCES if name not in order and uses[name] <= set(order)]
        assert ready, {name: sorted(uses[name]) for name in SOURCES if name not in order}
        order += ready
    assert "kquant.c" in uses["kquant_k.c"] or "kquant_k.c" in uses["kquant.c"]   # the check sees calls
