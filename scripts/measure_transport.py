"""Round trip of one step's messages between two processes: multiprocessing pipe vs pyzmq.

The front sends one CoreCommand (add, one 200-token prompt); the other process answers with one
StepOutputs of `--rows` single-token deltas, as the engine core does every step. Prints the median
and p99 round trip and the pickled sizes. Usage: python scripts/measure_transport.py [--rows 64]
(pyzmq is optional: without it only the pipe is measured).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time

from conveyor.engine.messages import AddRequests, CoreLoad, CoreRequest, StepOutputs, TokenDelta
from conveyor.engine.stats import StepStats
from conveyor.sampling_params import SamplingParams


def step_outputs(rows: int) -> StepOutputs:
    stats = StepStats(0, rows, rows, 0.05, rows, 0, 100, 0.1, 0, 0, 0)
    return StepOutputs([TokenDelta(f"cmpl-{i:032x}-0", [1000 + i]) for i in range(rows)],
                       CoreLoad(rows, 0, 100, 0.1), stats)


def command() -> AddRequests:
    request = CoreRequest("cmpl-" + "0" * 32, list(range(200)), SamplingParams(max_tokens=64), frozenset({2}),
                          time.monotonic())
    return AddRequests([request])


def pipe_echo(conn, rows: int) -> None:  # noqa: ANN001
    reply = step_outputs(rows)
    while (message := conn.recv()) is not None:
        conn.send(reply)


def zmq_echo(address: str, rows: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    reply = step_outputs(rows)
    while (message := pickle.loads(sock.recv())) is not None:
        sock.send(pickle.dumps(reply, protocol=5), copy=False)


def summary(name: str, times: list[float]) -> str:
    times = sorted(times)
    return (f"{name:6s} round trip: median {statistics.median(times) * 1e6:7.1f} us, "
            f"p99 {times[int(len(times) * 0.99)] * 1e6:7.1f} us")


def measure_pipe(rows: int, n: int) -> list[float]:
    ctx = mp.get_context("spawn")
    front, core = ctx.Pipe()
    process = ctx.Process(target=pipe_echo, args=(core, rows), daemon=True)
    process.start()
    core.close()
    message = command()
    times = []
    for i in range(n + 100):
        started = time.perf_counter()
        front.send(message)
        front.recv()
        if i >= 100:
            times.append(time.perf_counter() - started)
    front.send(None)
    process.join()
    return times


def measure_zmq(rows: int, n: int) -> list[float]:
    import zmq

    address = f"ipc://{tempfile.mkdtemp()}/core"
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    process = mp.get_context("spawn").Process(target=zmq_echo, args=(address, rows), daemon=True)
    process.start()
    message = command()
    times = []
    for i in range(n + 100):
        started = time.perf_counter()
        sock.send(pickle.dumps(message, protocol=5), copy=False)
        pickle.loads(sock.recv())
        if i >= 100:
            times.append(time.perf_counter() - started)
    sock.send(pickle.dumps(None))
    process.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    sizes = (len(pickle.dumps(command(), protocol=5)), len(pickle.dumps(step_outputs(args.rows), protocol=5)))
    outputs = step_outputs(args.rows)
    codec_times = []
    for _ in range(200):
        started = time.perf_counter()
        pickle.loads(pickle.dumps(outputs, protocol=5))
        codec_times.append(time.perf_counter() - started)
    codec_s = statistics.median(codec_times)
    print(f"pickled sizes: add command {sizes[0]} B, step outputs of {args.rows} rows {sizes[1]} B; "
          f"step outputs pickle+unpickle {codec_s * 1e6:.0f} us (median)")
    print(summary("pipe", measure_pipe(args.rows, args.n)))
    try:
        print(summary("zmq", measure_zmq(args.rows, args.n)))
    except ImportError:
        print("zmq: pyzmq is not installed")


if __name__ == "__main__":
    main()
