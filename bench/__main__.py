"""python -m bench NAME [args]: every benchmark, by its short name; `python -m bench NAME --help` gives its flags.

Each run's JSON goes through `bench.report.save_run` into --out-dir (docs/bench by default); BENCHMARKS.md
says which benchmark measures what and links every run.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one line); grouped as the packages are: what each group measures is its package's docstring
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": ("bench.serving.serve", "the serving client alone against any running OpenAI-compatible server"),
    "capacity": ("bench.serving.capacity", "the highest request rate served within a latency SLO, against llama-server"),
    "interference": ("bench.serving.interference", "the decoding streams' ITL while a long prompt is prefilled"),
    "head-of-line": ("bench.serving.head_of_line", "a short request's TTFT when it arrives behind a long prompt"),
    "served-overhead": ("bench.serving.served_overhead", "offline LLM.generate tok/s against conveyor serve's"),
    "live-view": ("bench.serving.live_view", "what an open live view costs the server's throughput and latency"),
    "soak": ("bench.serving.soak", "disconnects mid-stream and overload against a real server: no 5xx, nothing leaked"),
    "fuzz": ("bench.serving.fuzz", "Schemathesis against a real server, every operation of its OpenAPI document"),
    "prefix": ("bench.features.prefix", "prefix caching on against off: a late turn's TTFT, shared-prompt throughput"),
    "prefix-disk": ("bench.features.prefix_disk", "the prefix cache's disk tier: TTFT cold, from memory, after a restart"),
    "prefix-host": ("bench.features.prefix_host", "the prefix cache's host memory tier: TTFT cold, from memory, after "
                    "an eviction"),
    "structured": ("bench.features.structured", "what a JSON schema costs inside the continuous batch"),
    "speculative": ("bench.features.speculative", "speculative decoding (n-gram or a draft model) on against off"),
    "draft-cost": ("bench.features.draft_cost", "one step's time with 0..k draft tokens per request"),
    "kv-int8": ("bench.features.kv_int8", "the 8-bit KV cache against float16, beside llama.cpp's q8_0 cache"),
    "tensor-parallel": ("bench.features.tensor_parallel", "the bundled model with 2 tensor-parallel ranks against 1"),
    "fairness": ("bench.features.fairness", "one tenant's burst against another's single request, fair sharing on/off"),
    "replay": ("bench.features.replay", "the serving run's Poisson arrivals straight into an in-process engine core"),
    "limits": ("bench.kernels.limits", "matmul rate, bandwidth and decode-step floors of this machine"),
    "quant-gemm": ("bench.kernels.quant_gemm", "weight bytes per second of the quantized matmul kernels"),
    "kernel-ab": ("bench.kernels.kernel_ab", "the tree's quantized matmul against a git revision's, alternated in one process"),
    "scheduler-host": ("bench.kernels.scheduler_host", "the scheduler's host time per decode step, without a model"),
    "flex-attention": ("bench.kernels.flex_attention", "decode attention per step: SDPA against FlexAttention"),
    "accuracy": ("bench.accuracy.perplexity", "perplexity and KL divergence against the float model, with llama.cpp's"),
    "quant-accuracy": ("bench.accuracy.quant_accuracy", "perplexity and top-1 agreement of each --quantization"),
    "run": ("bench.peers.run", "conveyor and its peers on one workload, in one run"),
    "single": ("bench.peers.single", "single-request decode per weight format, against llama-server --parallel 1"),
    "real-models": ("bench.peers.real_models", "conveyor serve and its peers on the GGUF files users bring"),
    "paired-decode": ("bench.peers.paired_decode", "one-stream decode of conveyor and one peer in alternating rounds"),
    "compare": ("bench.peers.compare", "single-request and one-by-one decode against transformers' generate"),
    "cuda": ("bench.gpu.cuda", "on a CUDA GPU: conveyor offline and served against transformers' generate_batch"),
    "cuda-decode": ("bench.gpu.cuda_decode", "on a CUDA GPU: eager steps against CUDA graphs"),
    "cuda-gguf": ("bench.gpu.cuda_gguf", "on a CUDA GPU: a GGUF file in its own formats against bfloat16"),
}


def usage() -> str:
    lines = [__doc__.strip(), "", "benchmarks:"]
    group = ""
    for name, (module, line) in BENCHMARKS.items():
        package = module.split(".")[1]
        if package != group:
            group = package
            lines.append(f"  {package}/")
        lines.append(f"    {name:16s} {line}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m bench: no benchmark named {name!r}; choose from: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    result = importlib.import_module(BENCHMARKS[name][0]).main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
