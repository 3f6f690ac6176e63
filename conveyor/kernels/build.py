"""Build the C kernels for the CPU we run on, once, and cache the shared library on disk.

The machines change from run to run (AVX2-only parts and AVX-512 BF16/VNNI parts have both been
seen), so nothing is compiled for "the build machine": the CPU's features are read at run time,
each one we have a code path for becomes an explicit `-m` flag, and the cache key holds the
sources, the flags, the compiler's version and that feature set. A library built for one CPU is
never loaded on another.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = ("attention.c", "gemm.c", "layer.c", "quant.c", "kquant.c", "kquant_k.c", "kquant_repack.c", "decoder.c", "pool.c", "sampling.c", "stream.c", "shm_reduce.c")
HEADERS = ("pool.h", "kquant.h", "kq_vec.h", "half.h")   # hashed into the cache key with the sources
SOURCES += ("scan.c",)   # what the GGUF loader checks a file's scales with (model/gguf_validate.py)
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "conveyor" / "kernels"

# /proc/cpuinfo flag -> the compiler flag that enables code paths for it (the C code tests the macros).
FEATURE_FLAGS: dict[str, str] = {
    "avx2": "-mavx2",
    "fma": "-mfma",
    "f16c": "-mf16c",
    "avx512f": "-mavx512f",
    "avx512bw": "-mavx512bw",
    "avx512vl": "-mavx512vl",
    "avx512dq": "-mavx512dq",
    "avx512_bf16": "-mavx512bf16",
    "avx512_vnni": "-mavx512vnni",
    "avx_vnni": "-mavxvnni",
}
# Reassociation lets gcc vectorise the portable loops; finite-math stays off because the kernels use -inf.
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-fno-math-errno", "-mtune=generic")


@dataclass(frozen=True)
class KernelLibrary:
    lib: ctypes.CDLL
    features: frozenset[str]      # the CPU features the library was compiled to use
    path: Path


def cpu_features() -> frozenset[str]:
    """The features of this CPU that we have code paths for (empty off x86-64 Linux)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split()).intersection(FEATURE_FLAGS)
    return frozenset()


def describe(features: frozenset[str]) -> str:
    """The widest SIMD level a feature set reaches, for logs and benchmark reports."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= features:
        return "avx512+bf16" + ("+vnni" if "avx512_vnni" in features else "")
    if {"avx512f", "avx512bw", "avx512vl"} <= features:
        return "avx512"
    if {"avx2", "fma"} <= features:
        return "avx2+fma"
    return "portable"


def _compiler() -> tuple[str, str] | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()
    return compiler, (version[0] if version else "unknown")


def _writable(directory: Path) -> Path:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"conveyor-kernels-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def build(features: frozenset[str], cache_dir: Path = DEFAULT_CACHE_DIR) -> KernelLibrary | None:
    """Compile (or load from the cache) the kernels for `features`; None, with one warning, if impossible.

    `features` may be a subset of the CPU's, which tests use to run the narrower code paths.
    """
    found = _compiler()
    if found is None:
        logger.warning("no C compiler found: using the slower torch kernels")
        return None
    compiler, version = found
    flags = [*BASE_FLAGS, *(FEATURE_FLAGS[f] for f in sorted(features))]
    sources = [SOURCE_DIR / name for name in SOURCES]
    key = hashlib.sha256()
    for source in [*sources, *(SOURCE_DIR / name for name in HEADERS)]:
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    key.update("\0".join([*flags, version, *sorted(features)]).encode())
    directory = _writable(cache_dir)
    target = directory / f"conveyor-{key.hexdigest()[:20]}.so"
    if not target.exists():
        started = time.perf_counter()
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([compiler, *flags, "-o", str(tmp), *map(str, sources), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            logger.warning("building the C kernels failed; using the slower torch kernels:\n%s",
                           result.stderr[-2000:])
            return None
        os.replace(tmp, target)  # atomic: a concurrent builder never loads a half-written file
        logger.info("built the C kernels for %s in %.1f s -> %s", describe(features),
                    time.perf_counter() - started, target)
    else:
        logger.info("C kernels for %s from the cache: %s", describe(features), target)
    return KernelLibrary(ctypes.CDLL(str(target)), features, target)
