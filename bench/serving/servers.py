"""Server processes under test: `conveyor serve`, llama.cpp's `llama-server` and ik_llama.cpp's, each on
a free loopback port.

`launched(cmd, ...)` starts one, waits for /health and always ends it (SIGTERM, then SIGKILL). Its
log goes to a file next to the results, so a failed start can be diagnosed. It times the start
(process start to /health answering 200) and, when asked, samples the resident memory of the
server and all its children (conveyor's engine core is a child process) until it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.serving.client import wait_healthy
from conveyor.model.checkpoint import is_gguf

DEFAULT_PEERS_DIR = Path.home() / ".cache" / "conveyor-peers"
F32_GGUF_NAME = "SmolLM2-135M-Instruct.F32.gguf"
Q8_0_GGUF_NAME = "SmolLM2-135M-Instruct.Q8_0.gguf"   # both made by scripts/build_llama_cpp.sh
BUILD_HINT = "run scripts/build_llama_cpp.sh"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRss:
    """Peak resident memory of a process tree: RSS summed over the process and all its descendants,
    sampled on a thread every `interval_s` from `start()` until `stop()`. Pages shared between
    processes (a file both map) count once per process, as RSS does."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.process_peak_bytes: dict[int, int] = {}   # pid -> its own peak RSS (the root and each child)
        self.num_samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> PeakRss:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10)

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.Error):   # a child may end between listing and reading
                rss = proc.memory_info().rss
                total += rss
                self.process_peak_bytes[proc.pid] = max(self.process_peak_bytes.get(proc.pid, 0), rss)
        return total

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak_bytes = max(self.peak_bytes, self.sample())
            self.num_samples += 1
            self._done.wait(self.interval_s)


@dataclass
class Launched:
    base_url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float = 0.0                    # process start -> /health answered 200
    memory: PeakRss | None = field(default=None, repr=False)   # when launched(memory_interval_s=...)


@contextlib.contextmanager
def launched(cmd: list[str], port: int, log_path: Path, startup_timeout_s: float = 180.0,
             poll_s: float = 0.25, memory_interval_s: float | None = None,
             cwd: Path | None = None) -> Iterator[Launched]:
    """`poll_s`: how often /health is asked while starting (the resolution of `startup_s`); `cwd`: the
    server's working directory (`python -m` imports from it first)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, cwd=cwd)
        memory = PeakRss(process.pid, memory_interval_s).start() if memory_interval_s else None
        base_url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base_url, startup_timeout_s, is_alive=lambda: process.poll() is None, poll_s=poll_s)
            except (RuntimeError, TimeoutError) as exc:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}; command: {' '.join(cmd)}\n--- log tail ---\n{tail}") from exc
            yield Launched(base_url, process, log_path, time.perf_counter() - start, memory)
        finally:
            if memory is not None:
                memory.stop()
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


# ----------------------------------------------------------------------------- conveyor


def conveyor_command(port: int, *, model: str | None, threads: int, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None, kv_cache_memory: str | None = None,
                     dtype: str | None = "float32", quantization: str | None = "none",
                     extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`conveyor serve` on a loopback port; an option given as None is left to conveyor's own default;
    `extra`: further flags as they are written on the command line."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--log-level", "WARNING"]
    options = {"--dtype": dtype, "--quantization": quantization, "--max-num-seqs": max_num_seqs,
               "--max-num-batched-tokens": max_num_batched_tokens, "--kv-cache-memory": kv_cache_memory,
               "--model": model}
    for flag, value in options.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(extra)


# ----------------------------------------------------------------------------- llama.cpp


def binary_output(server: Path, flag: str) -> str:
    """stdout and stderr of `server flag` ("" where it cannot run)."""
    try:
        out = subprocess.run([str(server), flag], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def binary_version(server: Path) -> str:
    match = re.search(r"version: .*", binary_output(server, "--version"))
    return match.group(0) if match else "unknown"


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    src_dir: Path
    f32_gguf: Path

    @property
    def q8_0_gguf(self) -> Path:
        return self.f32_gguf.with_name(Q8_0_GGUF_NAME)

    @classmethod
    def find(cls, peers_dir: Path) -> LlamaCpp | None:
        src = peers_dir / "llama.cpp"
        server = src / "build" / "bin" / "llama-server"
        return cls(server, src, peers_dir / F32_GGUF_NAME) if server.is_file() else None

    def commit(self) -> str:
        """The llama.cpp commit: written by the build script from the sdist's changelog, else the binary's claim."""
        commit_file = self.src_dir / "COMMIT"
        if commit_file.is_file():
            return commit_file.read_text().strip()
        return self.version()

    def version(self) -> str:
        return binary_version(self.server)

    def help_text(self) -> str:
        return binary_output(self.server, "--help")

    def command(self, port: int, gguf: Path, *, parallel: int, ctx_per_slot: int, threads: int) -> list[str]:
        """Continuous batching over `parallel` slots, each with room for the longest request."""
        cmd = [str(self.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
               "--cache-ram", "0", "-ngl", "0", "--no-webui"]
        flags = self.help_text()
        if "-fit" in flags:
            cmd += ["-fit", "off"]
        if "--cont-batching" in flags:
            cmd += ["--cont-batching"]
        return [c for c in cmd if c != "--no-webui" or "--no-webui" in flags]


# ----------------------------------------------------------------------------- ik_llama.cpp

IK_BUILD_HINT = "build ik_llama.cpp there (cmake -B build && cmake --build build --target llama-server)"


def help_flags(help_text: str) -> set[str]:
    """The flags a server's --help names, as whole tokens: a substring test would take ik_llama's
    `--fit-margin` for llama-server's `-fit`."""
    return set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", help_text))


@dataclass(frozen=True)
class IkLlama:
    """ik_llama.cpp's llama-server, plain or with `-rtr` (tensors repacked to interleaved rows at load)."""

    server: Path
    src_dir: Path
    repack: bool = False

    @property
    def name(self) -> str:
        return "ik-llama-rtr" if self.repack else "ik-llama"

    @classmethod
    def find(cls, ik_dir: Path, repack: bool = False) -> IkLlama | None:
        server = ik_dir / "build" / "bin" / "llama-server"
        return cls(server, ik_dir, repack) if server.is_file() else None

    def commit(self) -> str:
        """The snapshot's "<sha> <date>" line, else the binary's claim."""
        snapshot = self.src_dir / "SNAPSHOT"
        if snapshot.is_file():
            lines = snapshot.read_text().strip().splitlines()
            if lines:
                return lines[0].strip()
        return binary_version(self.server)

    def help_text(self) -> str:
        return binary_output(self.server, "--help")

    def command(self, port: int, gguf: Path, *, parallel: int, ctx_per_slot: int, threads: int,
                help_text: str | None = None, trace_log: Path | None = None) -> list[str]:
        """As LlamaCpp.command, with the flags this build's --help names (`help_text`: given, or asked of
        the binary); flash attention is its default. `trace_log`: where its trace log goes (it adds
        ".log"; without it, llama.log in the working directory). Raises ValueError for -rtr on a build
        without it."""
        flags = help_flags(self.help_text() if help_text is None else help_text)
        cmd = [str(self.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
               "-ngl", "0"]
        if "-cram" in flags or "--cache-ram" in flags:   # its host prompt cache would answer repeats from memory
            cmd += ["-cram", "0"]
        if "-cb" in flags:
            cmd += ["-cb"]
        if "--no-webui" in flags:
            cmd += ["--no-webui"]
        if trace_log is not None and "--log-file" in flags:
            cmd += ["--log-file", str(trace_log)]
        if self.repack:
            if "-rtr" not in flags:
                raise ValueError(f"{self.server} has no -rtr in its --help")
            cmd += ["-rtr"]
        return cmd


# ----------------------------------------------------------------------------- both systems on one file

SYSTEMS = ("conveyor", "llama-server")


def add_system_arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The flags of a bench that serves one GGUF file with conveyor and llama-server in turn."""
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the bundled model)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of conveyor, llama-server")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--conveyor-args", default="", help="further `conveyor serve` flags, e.g. '--target-itl-ms 100'")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    p.add_argument("--out-dir", type=Path, default=Path("docs/bench"))
    p.add_argument("--log-dir", type=Path, default=Path("bench/results") / name)


def resolve_systems(args: argparse.Namespace) -> tuple[Path, list[str], LlamaCpp | None]:
    """(the GGUF file, the systems asked for, llama.cpp's build); exits with a message when one is missing."""
    from conveyor.model.checkpoint import default_model_path

    model = args.model or default_model_path()
    if not is_gguf(model):
        raise SystemExit(f"{model} is not a GGUF file")
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(chosen) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    llama = LlamaCpp.find(args.peers_dir)
    if "llama-server" in chosen and llama is None:
        raise SystemExit(f"llama-server not found under {args.peers_dir}: {BUILD_HINT}")
    return model, chosen, llama
