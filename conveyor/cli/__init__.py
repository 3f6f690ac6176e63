"""`conveyor generate | serve | run-batch`: flags -> configs (flags.py), handed to the code that runs them;
the one place that sets up logging for the command and prints to the terminal."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from conveyor.cli.flags import engine_options, parse_args, serve_configs
from conveyor.config import EngineConfig
from conveyor.replicas.config import ReplicaConfig
from conveyor.errors import ConveyorError
from conveyor.logging_setup import configure_logging
from conveyor.model.checkpoint import resolve_model_path

if TYPE_CHECKING:
    from ray.serve.deployment import Application

logger = logging.getLogger(__name__)


def generate(args: argparse.Namespace) -> int:
    from conveyor.front.llm_engine import LLMEngine
    from conveyor.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    engine = LLMEngine(EngineConfig.from_options(**engine_options(args)))
    if args.raw:
        prompt: str | list[int] = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    request_id = engine.add_request(prompt, params)
    finished = None
    while finished is None:
        for output in engine.step():
            if output.request_id != request_id:
                continue
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
            if output.finished:
                finished = output
    sys.stdout.write("\n")
    if finished.error:
        print(f"error: {finished.error}", file=sys.stderr)
        return 1
    metrics = finished.metrics
    if metrics is not None and metrics.first_token_s is not None and metrics.finished_s is not None:
        decode_s = metrics.finished_s - metrics.first_token_s
        rate = (metrics.num_output_tokens - 1) / decode_s if decode_s > 0 else float("nan")
        logger.info("%d prompt tokens, %d output tokens, TTFT %.3f s, decode %.1f tokens/s, finish %s",
                    metrics.num_prompt_tokens, metrics.num_output_tokens, metrics.ttft_s, rate,
                    finished.finish_reason)
    return 0


def serve(args: argparse.Namespace) -> int:
    config, server, replicas = serve_configs(args)
    if replicas is not None:
        try:
            from conveyor.replicas.launch import run_replicas
        except ImportError as exc:
            raise ValueError(f"--replicas needs Ray Serve: pip install 'conveyor[ray]' ({exc})") from None
        return run_replicas(config, server, replicas)
    began = time.perf_counter()
    started = None
    if server.core_process:
        # A model that is not there is said here, before a core process starts only to fail the same way.
        resolve_model_path(config.model.model)
        # The engine core starts now (Python, torch, the weights) while this process imports the server.
        from conveyor.engine.core_process import ProcessCoreClient

        started = ProcessCoreClient(config, logging.getLogger().getEffectiveLevel())
    from conveyor.server.api_server import run_server

    return run_server(config, server, started, began)


def ray_serve_app(args: dict[str, object]) -> Application:
    """The replicas application for Ray's CLI (`serve run conveyor.cli:ray_serve_app replicas=2 threads=1`):
    each key=value is one of `conveyor serve`'s flags that take a value."""
    from conveyor.replicas.deployments import build_application

    argv = ["serve"]
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    config, server, replicas = serve_configs(parse_args(argv))
    return build_application(config, server, replicas or ReplicaConfig())


def run_batch_command(args: argparse.Namespace) -> int:
    from conveyor.server.batch.run import run_batch

    input_path = Path(args.input_file)
    if not input_path.is_file():
        raise ValueError(f"input file not found: {input_path}")
    config = EngineConfig.from_options(**engine_options(args), served_model_name=args.served_model_name)
    return run_batch(config, input_path, Path(args.output_file), args.max_concurrent_requests)


def _exit_now(code: int) -> NoReturn:
    """Exit once the server has stopped and joined everything it started.

    The interpreter's own teardown (torch's modules and their finalizers) adds half a second on an
    idle machine and seconds on a busy one, after shutdown has already finished; nothing is left
    for it to do.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, "INFO" if args.command == "serve" else "WARNING")
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "serve":
            _exit_now(serve(args))
        if args.command == "run-batch":
            return run_batch_command(args)
    except (ConveyorError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1

