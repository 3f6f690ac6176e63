"""The `conveyor` command's flags: the parser of each subcommand, and flags -> configs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from conveyor import __version__
from conveyor.cli.speculative_flags import SPECULATIVE_FLAGS, add_speculative_flags, speculative_options
from conveyor.config import (
    ATTENTION_BACKENDS,
    BATCH_PRESETS,
    DEFAULT_BATCH_PRESET,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY,
    DTYPES,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    CacheConfig,
    EngineConfig,
    GrammarLimits,
    ModelConfig,
    ServerConfig,
)
from conveyor.replicas.config import ReplicaConfig

DTYPE_ALIASES = {"half": "float16", "float": "float32"}   # vLLM's spellings


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", "-m", default=None,
                       help="GGUF file or Hugging Face model folder (default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", choices=(*DTYPES, *DTYPE_ALIASES), default=ModelConfig.dtype,
                       help="working dtype of weights, activations and KV cache; auto: bfloat16 where the CPU has "
                            "native bf16 dot products (AVX-512 BF16), float32 elsewhere; half = float16, "
                            "float = float32")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file, or the template itself, instead of the model's own")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=ModelConfig.quantization,
                       help="auto: a GGUF file runs in its own formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, "
                            "Q6_K, IQ4_NL, IQ4_XS kept; other quantized types requantized to Q8_0, said at start-up; "
                            "with --device cuda Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K kept on the GPU, others "
                            "dequantized), a folder as loaded; none: weights "
                            "as loaded (GGUF dequantized to float); int8: linear layers in int8 (blocks of 32) from "
                            "any checkpoint; gguf: auto, refusing folders")
    group.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's choice)")
    group.add_argument("--device", default=ModelConfig.device, help="cpu or cuda[:N]")
    group.add_argument("--enforce-eager", action="store_true",
                       help="cuda: run every step eagerly instead of replaying decode steps from CUDA graphs")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=ModelConfig.attention_backend,
                       help="auto: the C kernel on CPU (torch SDPA without it), flex on CUDA; sdpa: SDPA over each "
                            "row's blocks gathered; flex: FlexAttention reading the KV blocks in place, so a step "
                            "costs the tokens its rows attend (compiled on CUDA at first use; float KV cache only)")
    group.add_argument("--batch-preset", choices=tuple(BATCH_PRESETS), default=None,
                       help="sets --target-itl-ms, --max-num-seqs, --max-num-batched-tokens and --min-prefill-chunk "
                            f"together; those flags, when given, win (default: {DEFAULT_BATCH_PRESET} on the CPU, "
                            "gpu on a GPU)")
    group.add_argument("--target-itl-ms", type=float, default=None,
                       help="keep steps that decode under this many ms by cutting prompt chunks; 0 = off "
                            "(balanced: 200)")
    group.add_argument("--max-num-seqs", "-np", type=int, default=None,
                       help="most requests in one batch (balanced: 64)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="most tokens computed in one step, so the largest prompt chunk (balanced: 512)")
    group.add_argument("--min-prefill-chunk", type=int, default=None,
                       help="prompt tokens a decoding step still takes when decodes alone miss the target "
                            "(balanced: 32)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="prompts longer than this are long (default: --max-num-batched-tokens)")
    group.add_argument("--long-prefill-max-slowdown", type=float, default=None,
                       help="while others decode, a long prompt's chunks lengthen a step by at most this fraction "
                            "of its decode time; 0 = no cap (default: 1.0)")
    group.add_argument("--long-prefill-max-chunk", type=int, default=None,
                       help="with nothing decoding, a long prompt's chunk takes at most this many tokens, so a "
                            "request arriving meanwhile waits for a shorter step; 0 = no cap (default: 256; only "
                            "with a target ITL)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=ModelConfig.tensor_parallel_size,
                       help="split every layer over this many processes (gloo, on this machine); it pays where a "
                            "model does not fit one process's memory or there are more cores than one rank uses")
    group.add_argument("--max-model-len", "-c", type=int, default=None,
                       help="longest prompt + output (default: the model's)")
    group.add_argument("--kv-cache-memory", default=None,
                       help=f"memory for the KV cache, e.g. 2GiB (default: {DEFAULT_KV_CACHE_MEMORY} on the CPU; "
                            "on a GPU what --gpu-memory-utilization leaves after the weights)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="GPU: the share of the card's memory the engine holds, weights and KV cache together; "
                            "the KV cache takes what the weights and a working reserve leave (default: "
                            f"{DEFAULT_GPU_MEMORY_UTILIZATION}; refused with --kv-cache-memory or on the CPU)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides memory)")
    group.add_argument("--kv-cache-dtype", choices=(*KV_CACHE_DTYPES, *DTYPE_ALIASES, *KV_CACHE_DTYPE_ALIASES),
                       default=CacheConfig.kv_cache_dtype,
                       help="dtype of the KV cache; auto: float16 where the weights are kept quantized (half the "
                            "bytes attention reads, as llama.cpp's default), else the working dtype; int8 (alias "
                            "q8_0): 8-bit codes with a scale per token and KV head, ~1.9x float16's tokens in "
                            "the same memory (CPU)")
    group.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=CacheConfig.enable_prefix_caching,
                       help="reuse the KV blocks of shared prompt prefixes (--no-enable-prefix-caching: recompute "
                            "them)")
    # No default of its own: the help would print the shared dest's "(default: True)" beside a "no" flag.
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       default=argparse.SUPPRESS, help="turn prefix caching off (the same as --no-enable-prefix-caching)")
    group.add_argument("--prefix-cache-dir", default=None,
                       help="a folder (only this user may write it) where full KV blocks are kept and found again "
                            "by later prompts, after a restart too; servers of the same user may share it "
                            "(default: memory only)")
    group.add_argument("--prefix-cache-disk-size", default=CacheConfig.prefix_cache_disk_size,
                       help="most bytes of KV blocks in --prefix-cache-dir, e.g. 20G; the least recently used go "
                            f"first (default {CacheConfig.prefix_cache_disk_size})")
    group.add_argument("--prefix-cache-host-size", default=CacheConfig.prefix_cache_host_size,
                       help="most bytes of full KV blocks kept in host memory (pinned on a GPU) beyond the KV cache, "
                            "in front of --prefix-cache-dir or alone, e.g. 8G; the least recently used go first "
                            "(default 0: off)")
    add_speculative_flags(group)
    group.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=WEIGHT",
                       help="a tenant's share of the batch relative to others (default 1), repeatable; the tenant "
                            "is a request's X-Tenant header or OpenAI user field")
    group.add_argument("--max-running-per-tenant", type=int, default=None,
                       help="most requests of one tenant in the batch at once (default: no cap)")
    group.add_argument("--max-priority-preemptions", type=int, default=None,
                       help="times a running request may give its place to a better-priority one (default 3)")
    group.add_argument("--log-level", default=None,
                       help="DEBUG, INFO, WARNING (default: WARNING for generate, INFO for serve)")


def _add_grammar_flags(parser: argparse.ArgumentParser) -> None:
    limits = GrammarLimits()
    group = parser.add_argument_group("structured outputs", "what the server compiles of a request's JSON "
                                      "schema, regex, choices or grammar; past a limit, a 400 naming it")
    group.add_argument("--max-grammar-bytes", type=int, default=limits.max_bytes,
                       help="longest schema, grammar or choice list, in bytes of its text")
    group.add_argument("--max-grammar-choices", type=int, default=limits.max_choices,
                       help="most guided_choice options, or enum and const values in one JSON schema")
    group.add_argument("--max-regex-chars", type=int, default=limits.max_regex_chars, help="longest regex")
    group.add_argument("--grammar-timeout", type=float, default=limits.timeout_s,
                       help="seconds a grammar may take to compile before its request is refused")
    group.add_argument("--grammar-compile-threads", type=int, default=limits.max_concurrent_compiles,
                       help="grammars compiled at once; others wait for a thread (within --grammar-timeout)")
    group.add_argument("--json-string-max-tokens", type=int, default=limits.json_string_max_tokens,
                       help="a JSON output's string ends after this many tokens: its closing quote is forced "
                            "where the schema allows one (a larger maxLength in the schema wins); 0 = unbounded "
                            "(default: 1024)")


def grammar_limits(args: argparse.Namespace) -> GrammarLimits:
    return GrammarLimits(max_bytes=args.max_grammar_bytes, max_choices=args.max_grammar_choices,
                         max_regex_chars=args.max_regex_chars, timeout_s=args.grammar_timeout,
                         max_concurrent_compiles=args.grammar_compile_threads,
                         json_string_max_tokens=args.json_string_max_tokens)


def _add_replica_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas", "several engines behind one HTTP endpoint, as a Ray Serve "
                                                  "deployment (needs: pip install 'conveyor[ray]')")
    group.add_argument("--replicas", type=int, default=None,
                       help="engines to run (the starting count when autoscaling; default: one engine, no Ray)")
    group.add_argument("--min-replicas", type=int, default=None,
                       help="autoscale: fewest engines Ray Serve keeps (default 1 when --max-replicas is given)")
    group.add_argument("--max-replicas", type=int, default=None,
                       help="autoscale: most engines Ray Serve starts (default: --replicas)")
    group.add_argument("--target-ongoing-requests", type=int, default=None,
                       help="autoscale: requests in flight per engine Ray Serve aims for; above it, it adds "
                            "engines (default: --max-num-seqs, so engines are added once requests wait)")
    group.add_argument("--ray-address", default=None,
                       help="the Ray cluster to deploy on: auto, or HEAD_HOST:6379 (default: start Ray on this "
                            "machine, on loopback only)")


def engine_options(args: argparse.Namespace) -> dict:
    return {
        "model": args.model, "dtype": DTYPE_ALIASES.get(args.dtype, args.dtype), "chat_template": args.chat_template, "quantization": args.quantization, "threads": args.threads,
        "tensor_parallel_size": args.tensor_parallel_size, "device": args.device,
        "enforce_eager": args.enforce_eager, "attention_backend": args.attention_backend,
        "batch_preset": args.batch_preset, **_given(args, "max_num_seqs", "max_num_batched_tokens", "min_prefill_chunk"),
        **({} if args.target_itl_ms is None else {"target_itl_ms": args.target_itl_ms or None}),
        **_given(args, "long_prefill_token_threshold"),
        **({} if args.long_prefill_max_slowdown is None
           else {"long_prefill_max_slowdown": args.long_prefill_max_slowdown or None}),
        **({} if args.long_prefill_max_chunk is None
           else {"long_prefill_max_chunk": args.long_prefill_max_chunk or None}),
        "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "prefix_cache_dir": args.prefix_cache_dir, "prefix_cache_disk_size": args.prefix_cache_disk_size,
        "prefix_cache_host_size": args.prefix_cache_host_size,
        "kv_cache_dtype": DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype),
        **speculative_options({"speculative": args.speculative, **_given(args, *SPECULATIVE_FLAGS)},
                              args.speculative_config),
        "tenant_weights": tenant_weights(args.tenant_weight),
        **_given(args, "max_running_per_tenant", "max_priority_preemptions"),
    }


def tenant_weights(flags: list[str]) -> tuple[tuple[str, float], ...]:
    weights = []
    for flag in flags:
        tenant, sep, weight = flag.rpartition("=")
        try:
            weights.append((tenant, float(weight)))
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"conveyor: error: --tenant-weight takes TENANT=WEIGHT, got {flag!r}")
    return tuple(weights)


def _given(args: argparse.Namespace, *names: str) -> dict:
    """Only the flags set on the command line, so the preset fills the rest."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows an option's default, as vLLM's --help does, unless its help already says it or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # A flag that turns something off (store_false) would read "(default: True)", backwards.
        if ("default" in text or not action.option_strings or action.default in (None, False, [], "")
                or action.default is argparse.SUPPRESS or isinstance(action, argparse._StoreFalseAction)):
            return text
        return f"{text} (default: %(default)s)"


def _add_served_model_name(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument("--served-model-name", default=None,
                        help=f"the model name {who} (default: the model file's name without .gguf, or the "
                             f"folder's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="An LLM serving engine built around continuous batching",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt, streaming the text to the terminal",
                         formatter_class=DefaultsHelpFormatter)
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_flags(gen)
    gen.set_defaults(subparser=gen)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)",
                           formatter_class=DefaultsHelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as in `vllm serve MODEL` (the same as --model)")
    serve.add_argument("--host", default=ServerConfig.host, help="address to listen on")
    serve.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on (0 = any free port)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics too (default: open, for Prometheus scrapers)")
    serve.add_argument("--disable-docs", dest="enable_docs", action="store_false",
                       help="remove /openapi.json and /docs (default: served, without the API key)")
    serve.add_argument("--no-dashboard", dest="enable_dashboard", action="store_false",
                       help="remove the live view of the batch, / and /dashboard (default: served; its event "
                            "stream needs the API key when one is set)")
    _add_served_model_name(serve, "clients send")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="requests allowed to wait for a batch slot (--max-num-seqs); past it the answer is a 429 "
                            "with Retry-After, before any response starts; 0 = no queue: accept only what can "
                            "start now (default: no limit)")
    serve.add_argument("--max-requests-per-tenant", type=int, default=None,
                       help="requests one tenant may have in flight (running or waiting); past it a 429 with "
                            "Retry-After (default: no limit)")
    serve.add_argument("--state-dir", default=None,
                       help="directory of the SQLite database that keeps batch jobs and files across restarts "
                            "(default: in memory, lost at exit)")
    serve.add_argument("--responses-store", default=None, metavar="PATH",
                       help="SQLite file of the Responses API's stored responses (store, previous_response_id), "
                            "shared by every server given the same path, e.g. replicas on one host (default: "
                            "responses.sqlite3 under --state-dir, else in memory)")
    serve.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longest prompt text, in characters, the server tokenizes; longer ones get a 413 before "
                            "tokenizing (default: max model length times the longest token, which no prompt that "
                            "fits can pass)")
    serve.add_argument("--header-timeout", type=float, default=ServerConfig.header_timeout_s,
                       help="seconds a connection has to send a request's headers before it is closed")
    serve.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout_s,
                       help="seconds a request has to send its body before it gets a 408")
    serve.add_argument("--keep-alive-timeout", type=float, default=ServerConfig.keep_alive_timeout_s,
                       help="seconds an idle keep-alive connection stays open")
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="most completions and chat completions in progress at once, streams included, from when "
                            "their body has arrived; past it new ones get 503 with Retry-After (other routes, and "
                            "requests without the API key, never count; default: no cap)")
    serve.add_argument("--core-stall-timeout", type=float, default=ServerConfig.core_stall_timeout_s,
                       help="seconds the engine core may send nothing while requests wait on it; past it /health "
                            "answers 503 and the requests in flight fail with a 503 until it steps again (0 = off)")
    _add_grammar_flags(serve)
    serve.add_argument("--shutdown-grace", type=float, default=ServerConfig.shutdown_grace_s,
                       help="seconds in-flight requests get to finish after SIGTERM before they fail")
    serve.add_argument("--disable-log-stats", dest="log_stats", action="store_false",
                       help=f"no periodic Running / Waiting / KV cache / throughput line (default: every "
                            f"{ServerConfig.stats_log_interval_s:g} s while there is work)")
    serve.add_argument("--seed", type=int, default=None,
                       help="seed the sampling of requests that bring no seed of their own, so a server restarted "
                            "with the same requests gives the same answers (default: random)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split a reasoning model's <think> part into reasoning_content (names as vLLM's)")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=ServerConfig.tool_call_parser,
                       help="the tool-call syntax read under tool_choice auto (names as vLLM's; auto: from the "
                            "chat template)")
    serve.add_argument("--no-core-process", dest="core_process", action="store_false",
                       help="run the engine core on a thread of the server process instead of a process of its own")
    _add_replica_flags(serve)
    _add_engine_flags(serve)
    serve.set_defaults(subparser=serve)

    batch = sub.add_parser("run-batch", help="run a file of OpenAI batch requests (JSONL), writing results as they "
                                             "finish; rerun to resume", formatter_class=DefaultsHelpFormatter)
    batch.add_argument("-i", "--input-file", required=True, help="OpenAI batch input: one request per line")
    batch.add_argument("-o", "--output-file", required=True,
                       help="results, one line per request (appended; custom_ids already there are skipped)")
    batch.add_argument("--max-concurrent-requests", type=int, default=None,
                       help="requests in flight at once (default: twice --max-num-seqs)")
    _add_served_model_name(batch, "the lines' bodies name (a file written for another model runs as it is)")
    _add_engine_flags(batch)
    batch.set_defaults(subparser=batch)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags -> namespace; a mistake is reported with the usage of the subcommand it was made in."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if args.model is not None and args.model != model_tag:
            args.subparser.error(f"the model is given twice: {model_tag!r} and --model {args.model!r}")
        args.model = model_tag
    return args


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, ReplicaConfig | None]:
    """The serve flags as configs; the replica config is None unless a replica flag was given."""
    config = EngineConfig.from_options(**engine_options(args), served_model_name=args.served_model_name,
                                       seed=args.seed)
    server = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests, shutdown_grace_s=args.shutdown_grace,
                          max_prompt_chars=args.max_prompt_chars, header_timeout_s=args.header_timeout,
                          body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                          max_concurrency=args.max_concurrency, protect_metrics=args.protect_metrics,
                          core_stall_timeout_s=args.core_stall_timeout,
                          enable_docs=args.enable_docs,
                          stats_log_interval_s=ServerConfig.stats_log_interval_s if args.log_stats else 0.0,
                          core_process=args.core_process, max_requests_per_tenant=args.max_requests_per_tenant,
                          state_dir=args.state_dir, responses_store=args.responses_store,
                          enable_dashboard=args.enable_dashboard,
                          grammar=grammar_limits(args), reasoning_parser=args.reasoning_parser,
                          tool_call_parser=args.tool_call_parser)
    replica_flags = (args.replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests,
                     args.ray_address)
    if all(flag is None for flag in replica_flags):
        return config, server, None
    num_replicas = args.replicas if args.replicas is not None else max(1, args.min_replicas or 1)
    replicas = ReplicaConfig(num_replicas=num_replicas, min_replicas=args.min_replicas,
                             max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                             ray_address=args.ray_address)
    return config, server, replicas
