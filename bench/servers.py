"""Server processes under test: `conveyor serve` and llama.cpp's `llama-server`, each on a free loopback port.

`launched(cmd, ...)` starts one, waits for /health and always ends it (SIGTERM, then SIGKILL). Its
log goes to a file next to the results, so a failed start can be diagnosed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.client import wait_healthy

DEFAULT_PEERS_DIR = Path.home() / ".cache" / "conveyor-peers"
F32_GGUF_NAME = "SmolLM2-135M-Instruct.F32.gguf"
Q8_0_GGUF_NAME = "SmolLM2-135M-Instruct.Q8_0.gguf"   # both made by scripts/build_llama_cpp.sh
BUILD_HINT = "run scripts/build_llama_cpp.sh"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    base_url: str
    process: subprocess.Popen
    log_path: Path


@contextlib.contextmanager
def launched(cmd: list[str], port: int, log_path: Path, startup_timeout_s: float = 180.0) -> Iterator[Launched]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base_url, startup_timeout_s, is_alive=lambda: process.poll() is None)
            except (RuntimeError, TimeoutError) as exc:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}; command: {' '.join(cmd)}\n--- log tail ---\n{tail}") from exc
            yield Launched(base_url, process, log_path)
        finally:
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


def conveyor_command(port: int, *, model: str | None, threads: int, max_num_seqs: int,
                     max_num_batched_tokens: int, kv_cache_memory: str, dtype: str = "float32",
                     quantization: str = "none") -> list[str]:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--dtype", dtype, "--quantization", quantization,
           "--max-num-seqs", str(max_num_seqs),
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--kv-cache-memory", kv_cache_memory,
           "--log-level", "WARNING"]
    if model is not None:
        cmd += ["--model", model]
    return cmd


# ----------------------------------------------------------------------------- llama.cpp


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
        try:
            out = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({exc})"
        match = re.search(r"version: .*", out.stdout + out.stderr)
        return match.group(0) if match else "unknown"

    def help_text(self) -> str:
        try:
            out = subprocess.run([str(self.server), "--help"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout + out.stderr

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
