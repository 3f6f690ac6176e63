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
import json
import logging
import pickle
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from conveyor.core.plan import StepPlan
from conveyor.model.llama import LlamaModel
from conveyor.runtime.batch import Batch
from conveyor.runtime.kv_cache import KVCache
from conveyor.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


class GlooCollectives:
    """One rank's gloo process group, used directly (no global default group, so several engines
    can live in one process)."""

    def __init__(self, rank: int, world_size: int, port: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
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


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each plan, then runs its own shard like any ModelRunner."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: torch.device, comm: GlooCollectives,
                 workers: list[subprocess.Popen]) -> None:
        super().__init__(model, kv_cache, device)
        self.comm = comm
        self.workers = workers
        # The workers shape their caches alike: the same block ids address every rank's heads.
        comm.broadcast_object((kv_cache.num_blocks, kv_cache.block_size, kv_cache.transposed_keys))

    def execute(self, plan: StepPlan) -> tuple[Batch, torch.Tensor]:
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
    from pathlib import Path

    from conveyor import kernels
    from conveyor.model.loader import load_model
    from conveyor.model.sharding import Shard

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(spec.threads)
    comm = GlooCollectives(rank, spec.world_size, spec.port, spec.timeout_s)
    dtype = getattr(torch, spec.dtype)
    library = kernels.library()
    if library is not None:
        kernels.threads.set_num_threads(spec.threads)
    model = load_model(Path(spec.model_path), dtype, "cpu", library, shard=Shard(rank, spec.world_size), comm=comm)
    num_blocks, block_size, transposed = comm.broadcast_object()
    runner = ModelRunner(model, KVCache(model.arch, num_blocks, block_size, dtype, "cpu", transposed), torch.device("cpu"))
    while (plan := comm.broadcast_object()) is not None:
        runner.execute(plan)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tensor-parallel worker (started by the engine core)")
    parser.add_argument("rank", type=int)
    parser.add_argument("spec", type=json.loads)
    args = parser.parse_args()
    worker_main(args.rank, WorkerSpec(**args.spec))
