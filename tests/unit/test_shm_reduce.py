"""The shared-memory all-reduce of tensor-parallel ranks (kernels/shm_reduce.c), between real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor import kernels
from conveyor.runtime.tensor_parallel import SharedMemoryReduce, create_shm_segment

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler: the all-reduce is a C kernel")

PEER = """
import sys, torch
from conveyor.runtime.tensor_parallel import SharedMemoryReduce
path, pid0, pid1 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
reduce = SharedMemoryReduce(path, 1, 2, [pid0, pid1], 30.0)
for step in range(50):
    x = torch.arange(1000, dtype=torch.float32) * (step + 1) + 0.1
    reduce.all_reduce_(x)
    torch.save(x, path + f".{step}")
"""


def test_two_processes_get_the_same_sum(tmp_path: Path) -> None:
    import os

    path = create_shm_segment(2)
    assert path is not None
    peer = subprocess.Popen([sys.executable, "-c", PEER, path, str(os.getpid()), "0"])
    try:
        # The peer needs its own pid in the list: it is only known once started, so rank 0 passes 0
        # for it above and its own list here; liveness checks only look at the other rank.
        reduce = SharedMemoryReduce(path, 0, 2, [os.getpid(), peer.pid], 30.0)
        sums = []
        for step in range(50):
            x = torch.full((1000,), 0.5 * step, dtype=torch.float32)
            want = x + torch.arange(1000, dtype=torch.float32) * (step + 1) + 0.1
            reduce.all_reduce_(x)
            assert torch.equal(x, want)   # two addends: exact
            sums.append(x)
        assert peer.wait(30) == 0
        assert all(torch.equal(torch.load(path + f".{step}"), sums[step]) for step in range(50))   # the same bits
    finally:
        peer.kill()
        for file in Path(path).parent.glob(Path(path).name + "*"):
            file.unlink()


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    import os

    path = create_shm_segment(2)
    assert path is not None
    try:
        peer = subprocess.Popen([sys.executable, "-c", "pass"])
        while subprocess.run(["test", "-d", f"/proc/{peer.pid}"]).returncode == 0 and not _zombie(peer.pid):
            time.sleep(0.01)   # exited, not reaped: kill(pid, 0) still succeeds for it
        reduce = SharedMemoryReduce(path, 0, 2, [os.getpid(), peer.pid], 30.0)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="process is gone"):
            reduce.all_reduce_(torch.ones(10))
        assert time.monotonic() - started < 5
        peer.wait()
    finally:
        os.unlink(path)


def _zombie(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "ZX"
