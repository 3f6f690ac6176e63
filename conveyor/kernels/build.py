"""Build the C kernels for the CPU we run on, once, and cache the shared library on disk.

The machines change from run to run (AVX2-only parts and AVX-512 BF16/VNNI parts have both been
seen), so nothing is compiled for "the build machine": the CPU's features are read at run time,
each one we have a code path for becomes an explicit `-m` flag, and the cache key holds the
sources, the flags, the compiler's version and that feature set. A library built for one CPU is
never loaded on another.

A cached library is code we will run: it is read only from a folder no other user can write, and
loaded only when its bytes have the sha256 recorded beside it when it was built.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from conveyor.private_cache import CACHE_ROOT, private_dir, read_private_file, write_atomically

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = ("attention.c", "attention_i8.c", "gemm.c", "layer.c", "quant.c", "kquant.c", "kquant_k.c", "kquant_sets.c",
           "kquant_repack.c", "decoder.c", "pool.c", "sampling.c", "argmax.c", "stream.c", "shm_reduce.c",
           "formats.c", "embed.c")
HEADERS = ("kernels.h", "pool.h", "kq_vec.h", "kq_codes.h", "half.h")   # hashed into the cache key with the sources
SOURCES += ("scan.c",)   # what the GGUF loader checks a file's scales with (model/gguf/validate.py)
DEFAULT_CACHE_DIR = CACHE_ROOT / "conveyor" / "kernels"
MAX_LIBRARY_BYTES = 256 << 20

# /proc/cpuinfo flag -> the compiler flag that enables code paths for it (kernels.h turns the macros into tiers).
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

# AddressSanitizer and UBSan (any undefined behaviour stops the process), for tests and CI.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
                  "-g", "-DKN_SANITIZE")


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


# The narrower code paths a wider CPU can also run, as the features that select them (each taken within
# the CPU's own): tests and benchmarks build them to check every path gives the same bits.
AVX2 = frozenset({"avx2", "fma", "f16c"})
NARROWER_BUILDS: dict[str, frozenset[str]] = {
    "avx2": AVX2,
    "vnni256": AVX2 | {"avx512f", "avx512vl", "avx512_vnni", "avx_vnni"},   # 256-bit VNNI in the AVX2 tiles
    "portable": frozenset(),
}


def builds(features: frozenset[str], names: tuple[str, ...] = ("native", *NARROWER_BUILDS)) -> dict[str, frozenset[str]]:
    """The feature set of each named build this CPU can run ("native": all of `features`); a narrower
    build that would come out as another one on this CPU (vnni256 without VNNI) is left out."""
    found = {"native": features, **{name: want & features for name, want in NARROWER_BUILDS.items()}}
    picked = {name: found[name] for name in names}
    if "vnni256" in picked and quant_isa(picked["vnni256"]) != "avx2-vnni":
        del picked["vnni256"]
    return picked


def quant_isa(features: frozenset[str]) -> str:
    """The quantized kernels' code path a build for `features` takes: kernels.h's tiers, which the
    library reports (formats.isa_name) and tests compare with this."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"} <= features:
        return "avx512-vnni"
    if AVX2 <= features:
        return "avx2-vnni" if "avx_vnni" in features or {"avx512_vnni", "avx512vl"} <= features else "avx2"
    return "portable"


def compile_flags(features: frozenset[str], sanitize: bool = False) -> list[str]:
    """The compiler's flags for a build using `features` (part of the cache key)."""
    return [*BASE_FLAGS, *(FEATURE_FLAGS[f] for f in sorted(features)), *(SANITIZE_FLAGS if sanitize else ())]


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


def _load_verified(target: Path, sanitize: bool) -> ctypes.CDLL | None:
    """The library at `target` when its bytes have the digest its sidecar recorded at build time; a
    truncated, edited or unrecorded file is never loaded (it would fault, or run someone's code)."""
    recorded = read_private_file(_sidecar(target), 128)
    data = read_private_file(target, MAX_LIBRARY_BYTES)
    if recorded is None or data is None or hashlib.sha256(data).hexdigest().encode() != recorded.strip():
        return None
    return _open(target, sanitize)


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _compile(compiler: str, flags: list[str], out: Path) -> bool:
    """Each source to an object file, as many at once as there are cores, then one link into `out`."""
    with tempfile.TemporaryDirectory(prefix="conveyor-build-") as work:
        def run(args: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run([compiler, *args], capture_output=True, text=True)

        objects = [str(Path(work) / f"{name}.o") for name in SOURCES]
        compile_flags = [f for f in flags if f != "-shared"]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            results = list(pool.map(run, [[*compile_flags, "-c", "-o", obj, str(SOURCE_DIR / name)]
                                          for name, obj in zip(SOURCES, objects)]))
        if all(r.returncode == 0 for r in results):
            results.append(run([*flags, "-o", str(out), *objects, "-lm"]))
        failed = [r for r in results if r.returncode != 0]
    if failed:
        out.unlink(missing_ok=True)
        logger.warning("building the C kernels failed; using the slower torch kernels:\n%s", failed[0].stderr[-2000:])
    return not failed


def _open(path: Path, sanitize: bool) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        if sanitize:   # an ASan library loads only into a process that started with the ASan runtime
            raise RuntimeError(f"the sanitizer build of the C kernels cannot load ({exc}): run python with "
                               "LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0") from exc
        raise


def build(features: frozenset[str], cache_dir: Path = DEFAULT_CACHE_DIR, cache_root: Path | None = None,
          sanitize: bool = False) -> KernelLibrary | None:
    """Compile (or load from the cache) the kernels for `features`; None, with one warning, if impossible.

    `features` may be a subset of the CPU's, which tests use to run the narrower code paths. The cache
    is used only where every folder from `cache_root` (default: ~/.cache for the default folder, else
    `cache_dir` itself) down is this user's alone; elsewhere the library is built for this process in a
    private temporary folder. `sanitize` builds with AddressSanitizer and UBSan (tests and CI).
    """
    found = _compiler()
    if found is None:
        logger.warning("no C compiler found: using the slower torch kernels")
        return None
    compiler, version = found
    flags = compile_flags(features, sanitize)
    key = hashlib.sha256()
    for source in [*(SOURCE_DIR / name for name in SOURCES), *(SOURCE_DIR / name for name in HEADERS)]:
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    key.update("\0".join([*flags, version, *sorted(features)]).encode())
    name = f"conveyor-{key.hexdigest()[:20]}.so"
    directory = private_dir(cache_dir, cache_root)
    if directory is None:
        logger.warning("%s is not a folder only this user can write: building the C kernels for this process "
                       "only (a private temporary folder)", cache_dir)
        return _build_private(compiler, flags, features, name, sanitize)
    target = directory / name
    lib = _load_verified(target, sanitize)
    if lib is not None:
        logger.info("C kernels for %s from the cache: %s", describe(features), target)
        return KernelLibrary(lib, features, target)
    started = time.perf_counter()
    partial = directory / f".{name}.{os.getpid()}.tmp"
    if not _compile(compiler, flags, partial):
        return None
    try:
        partial.chmod(0o700)   # whatever the umask: a group-writable file would never be read back
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        os.replace(partial, target)   # atomic: a reader sees the old file or the new one, whole
        write_atomically(_sidecar(target), digest.encode() + b"\n")
    except OSError as exc:
        partial.unlink(missing_ok=True)
        logger.warning("the C kernels could not be cached in %s (%s): building them for this process only",
                       directory, exc)
        return _build_private(compiler, flags, features, name, sanitize)
    logger.info("built the C kernels for %s in %.1f s -> %s", describe(features), time.perf_counter() - started,
                target)
    lib = _load_verified(target, sanitize)
    if lib is None:   # another process replaced it between our write and read: never load unverified bytes
        return _build_private(compiler, flags, features, name, sanitize)
    return KernelLibrary(lib, features, target)


def _build_private(compiler: str, flags: list[str], features: frozenset[str], name: str,
                   sanitize: bool) -> KernelLibrary | None:
    """The library built into a fresh folder only this process knows (mode 0700), loaded, then removed."""
    folder = Path(tempfile.mkdtemp(prefix="conveyor-kernels-"))
    try:
        target = folder / name
        if not _compile(compiler, flags, target):
            return None
        return KernelLibrary(_open(target, sanitize), features, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)   # a loaded library stays mapped
