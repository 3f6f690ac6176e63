"""Tensor parallelism on torch.distributed: rank 0 is the engine core, ranks 1..N-1 are workers.

The scheduler runs once, in rank 0's core; each step rank 0 broadcasts the StepPlan and every rank
runs the same forward over its shard (model/parallel_llama.py) and its shard of the KV cache (its
own KV heads, the same block ids), so ranks never disagree on a plan. Workers are plain child
processes (`python -m conveyor.runtime.tensor_parallel ...`), as torchrun would start them; they
meet rank 0 through a TCPStore on loopback and use gloo (CPU). A worker that dies, or a
collective that fails, raises WorkerLost in rank 0: the core then fails every request and stops.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from conveyor import kernels
from conveyor.core.plan import StepPlan
from conveyor.kernels import KernelLibrary
from conveyor.model.llama import LlamaModel
from conveyor.model.sharding import Shard
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


class GlooCollectives:
    """One rank's gloo process group, used directly (no global default group, so several engines
    can live in one process). With the C kernels, all-reduces of float32 up to a slot's size go
    through shared memory instead (kernels/shm_reduce.c: microseconds where gloo's TCP takes ~0.5 ms)."""

    def __init__(self, rank: int, world_size: int, port: int, timeout_s: float, shm_path: str | None = None) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.shm: SharedMemoryReduce | None = None
        if shm_path is not None:
            pids = [int(p.item()) for p in self.all_gather(torch.tensor([os.getpid()], dtype=torch.int64))]
            self.shm = SharedMemoryReduce(shm_path, rank, world_size, pids, timeout_s)
            self.all_gather(torch.zeros(1))   # every rank has mapped the segment: its name can go
            if rank == 0:
                os.unlink(shm_path)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        if self.shm is not None and self.shm.fits(tensor):
            self.shm.all_reduce_(tensor)
        else:
            self.group.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([parts], [tensor]).wait()
        return parts

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled: plans are small)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast([size], _root0()).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.broadcast([data], _root0()).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())


SHM_SLOT_ELEMS = 1 << 20   # floats per rank: a step's hidden states up to 1M values (larger ones use gloo)


def create_shm_segment(world_size: int) -> str | None:
    """A shared-memory file for the all-reduce, sized for `world_size` ranks; None without the C kernels."""
    if kernels.library() is None:
        return None
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="conveyor-tp-", dir=directory)
    os.ftruncate(fd, SharedMemoryReduce.segment_bytes(world_size))   # sparse: pages appear as used
    os.close(fd)
    return path


class SharedMemoryReduce:
    def __init__(self, path: str, rank: int, world_size: int, pids: list[int], timeout_s: float) -> None:
        built = kernels.library()
        assert built is not None, "the shared-memory all-reduce is a C kernel"
        self.lib = built.lib
        self.rank, self.world_size = rank, world_size
        with open(path, "r+b") as file:
            self.map = mmap.mmap(file.fileno(), self.segment_bytes(world_size))
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.pids = torch.tensor(pids, dtype=torch.int64)
        self.timeout_ns = int(timeout_s * 1e9)
        self.round = 0

    @staticmethod
    def segment_bytes(world_size: int) -> int:
        return world_size * 64 + world_size * SHM_SLOT_ELEMS * 4

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.numel() <= SHM_SLOT_ELEMS

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        self.round += 1
        status = self.lib.shm_allreduce(tensor.data_ptr(), tensor.numel(), self.address, SHM_SLOT_ELEMS, self.rank,
                                        self.world_size, self.round, self.pids.data_ptr(), self.timeout_ns)
        if status:
            raise RuntimeError("shared-memory all-reduce: " + ("a rank's process is gone" if status == -2
                                                                else "a rank did not answer in time"))


def _root0() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard: everything else comes from rank 0 at run time."""

    model_path: str
    dtype: str            # torch dtype name, e.g. "float32"
    threads: int
    world_size: int
    port: int
    timeout_s: float
    log_level: int
    shm_path: str | None = None   # the shared-memory all-reduce's segment, made by rank 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_workers(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        worker.kill()
        worker.wait()


def start_workers(spec: WorkerSpec) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "conveyor.runtime.tensor_parallel", str(rank),
                              json.dumps(asdict(spec))])
            for rank in range(1, spec.world_size)]


TIMEOUT_S = 60.0   # a rank that does not answer a collective for this long is taken for dead


def load_rank0(model_path: Path, dtype: torch.dtype, kernel_library: KernelLibrary | None, world_size: int,
               num_threads: int) -> tuple[LlamaModel, GlooCollectives, list[subprocess.Popen]]:
    """Start ranks 1..N-1 (they load their shards meanwhile), join them, and load rank 0's shard."""
    from conveyor.model.loader import load_model

    spec = WorkerSpec(str(model_path), str(dtype).removeprefix("torch."), num_threads, world_size, free_port(),
                      TIMEOUT_S, logging.getLogger().getEffectiveLevel(), create_shm_segment(world_size))
    workers = start_workers(spec)
    torch.set_num_threads(num_threads)
    if kernel_library is not None:
        kernels.threads.set_num_threads(num_threads)
    logger.info("tensor parallel: %d ranks (gloo on loopback), %d threads each", world_size, num_threads)
    try:
        comm = GlooCollectives(0, world_size, spec.port, spec.timeout_s, spec.shm_path)
        model = load_model(model_path, dtype, "cpu", kernel_library, "none", Shard(0, world_size), comm)
    except BaseException:
        stop_workers(workers)
        if spec.shm_path is not None and os.path.exists(spec.shm_path):
            os.unlink(spec.shm_path)
        raise
    return model, comm, workers


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each plan, then runs its own shard like any ModelRunner."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device, comm: GlooCollectives,
                 workers: list[subprocess.Popen]) -> None:
        super().__init__(model, kv_cache, device)
        self.comm = comm
        self.workers = workers
        # The workers shape their caches alike: the same block ids address every rank's heads.
        comm.broadcast_object((kv_cache.num_blocks, kv_cache.block_size, kv_cache.transposed_keys,
                               str(kv_cache.tensor.dtype).removeprefix("torch.")))

    def execute(self, plan: StepPlan) -> torch.Tensor:
        for rank, worker in enumerate(self.workers, start=1):
            if worker.poll() is not None:
                raise WorkerLost(f"tensor-parallel rank {rank} exited (code {worker.returncode})")
        try:
            self.comm.broadcast_object(plan)
            return super().execute(plan)
        except Exception as exc:   # a gloo error for a peer that went away, or a failure on this rank:
            # either way the other ranks are left inside a collective, so no further step can agree.
            raise WorkerLost(f"a tensor-parallel step failed, the ranks are out of step: {exc}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        if all(worker.poll() is None for worker in self.workers):
            try:
                self.comm.broadcast_object(None)
            except RuntimeError:
                pass
        for worker in self.workers:
            try:
                worker.wait(timeout_s)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def worker_main(rank: int, spec: WorkerSpec) -> None:
    from conveyor.model.loader import load_model

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    comm = GlooCollectives(rank, spec.world_size, spec.port, spec.timeout_s, spec.shm_path)
    dtype = getattr(torch, spec.dtype)
    library = kernels.library()
    if library is not None:
        kernels.threads.set_num_threads(spec.threads)
    model = load_model(Path(spec.model_path), dtype, "cpu", library, shard=Shard(rank, spec.world_size), comm=comm)
    num_blocks, block_size, transposed, kv_dtype = comm.broadcast_object()
    kv_cache = KVCache(model.arch, num_blocks, block_size, getattr(torch, kv_dtype), "cpu", transposed)
    runner = ModelRunner(model, kv_cache, torch.device("cpu"))
    while (plan := comm.broadcast_object()) is not None:
        runner.execute(plan)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tensor-parallel worker (started by the engine core)")
    parser.add_argument("rank", type=int)
    parser.add_argument("spec", type=json.loads)
    args = parser.parse_args()
    worker_main(args.rank, WorkerSpec(**args.spec))
