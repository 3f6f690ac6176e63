"""Typed, frozen configuration: Model / Cache / Scheduler -> EngineConfig, validated on creation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from conveyor.config_values import parse_bytes, positive as _positive

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES = (*DTYPES, "int8"), {"q8_0": "int8"}   # llama.cpp's -ctk q8_0
# auto: a GGUF file runs in its own formats where kernels exist, anything else as loaded; none: weights
# as loaded (GGUF dequantized to float); int8: linear layers quantized to int8 (blocks of 32) from any
# checkpoint; gguf: auto, for GGUF files only. See model/quant.py.
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
# auto: the C kernel on CPU where built (else torch's SDPA over gathered blocks), flex on CUDA; sdpa: always
# the SDPA path; flex: FlexAttention reading the cache blocks in place (compiled on CUDA). See flex_paged.py.
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")
QUANTIZED_LAYERS = ("auto", "torch")

@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # path to a GGUF file or a Hugging Face folder; None = bundled
    dtype: str = "auto"                # "auto": bfloat16 where the CPU multiplies it natively, else float32
    threads: int | None = None        # torch intra-op threads; None leaves torch's default
    device: str = "cpu"
    served_model_name: str | None = None
    quantization: str = "auto"        # one of QUANTIZATIONS
    seed: int | None = None           # seeds the generator of requests without a seed of their own
    chat_template: str | None = None  # a Jinja file or the template itself, instead of the checkpoint's
    tensor_parallel_size: int = 1     # ranks that each hold a slice of every layer (gloo on loopback)
    enforce_eager: bool = False       # cuda: run decode steps eagerly, not replayed from CUDA graphs
    attention_backend: str = "auto"   # one of ATTENTION_BACKENDS
    # "auto": a GGUF file kept quantized runs on the C kernels on the CPU, in torch's layers on a GPU;
    # "torch": in torch's layers on any device (how tests run the GPU's path on the CPU)
    quantized_layers: str = "auto"

    def __post_init__(self) -> None:
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and (self.quantization not in ("none", "auto") or self.device != "cpu"):
            raise ValueError("tensor_parallel_size > 1 runs float weights on the CPU (gloo): drop the quantization "
                             "and device options")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantized_layers not in QUANTIZED_LAYERS:
            raise ValueError(f"quantized_layers must be one of {', '.join(QUANTIZED_LAYERS)}, "
                             f"got {self.quantized_layers!r}")
        if (self.quantization not in ("none", "auto") and self.dtype not in ("float32", "auto")
                and self.device == "cpu" and self.quantized_layers != "torch"):
            raise ValueError(f"quantization {self.quantization!r} runs with float32 activations; "
                             f"got dtype {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "flex" and self.tensor_parallel_size > 1:
            raise ValueError("attention_backend 'flex' runs in one process: drop tensor_parallel_size")
        _positive("threads", self.threads, allow_none=True)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


DEFAULT_KV_CACHE_MEMORY = "2GiB"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9   # vLLM's


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: 2GiB on the CPU; on a GPU, what gpu_memory_utilization of the card leaves after the weights
    kv_cache_memory: str | int | None = None
    # share of the GPU's memory the engine may hold (weights + KV); None: DEFAULT_GPU_MEMORY_UTILIZATION
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    enable_prefix_caching: bool = True
    # "auto": float16 where the weights are kept quantized (as llama.cpp keeps its cache), else the
    # working dtype; "int8" (or "q8_0"): about half of float16's bytes per token
    kv_cache_dtype: str = "auto"
    # A second tier of the prefix cache: full blocks are written here and read back, across restarts.
    prefix_cache_dir: str | None = None
    prefix_cache_disk_size: str | int = "10GiB"
    prefix_cache_host_size: str | int = 0   # host memory for full blocks, in front of the disk or alone; 0: off

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        parse_bytes(self.prefix_cache_disk_size, "prefix_cache_disk_size")
        has_host_tier = parse_bytes(self.prefix_cache_host_size, "prefix_cache_host_size", allow_zero=True) > 0
        if self.prefix_cache_dir is not None and not (self.prefix_cache_dir and isinstance(self.prefix_cache_dir, str)):
            raise ValueError(f"prefix_cache_dir must be a folder path, got {self.prefix_cache_dir!r}")
        if (self.prefix_cache_dir is not None or has_host_tier) and not self.enable_prefix_caching:
            raise ValueError(f"{'prefix_cache_dir' if self.prefix_cache_dir is not None else 'prefix_cache_host_size'}"
                             " needs enable_prefix_caching: the second tiers are the prefix cache's")
        if self.kv_cache_dtype in KV_CACHE_DTYPE_ALIASES:
            object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_ALIASES[self.kv_cache_dtype])
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _positive("num_kv_blocks", self.num_kv_blocks, allow_none=True)
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.gpu_memory_utilization is not None and (
                isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {self.gpu_memory_utilization!r}")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's memory where it is given or the CPU default applies (a GPU sizes it from free memory)."""
        return parse_bytes(self.kv_cache_memory if self.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY,
                           "kv_cache_memory")

    @property
    def prefix_cache_disk_bytes(self) -> int:
        return parse_bytes(self.prefix_cache_disk_size, "prefix_cache_disk_size")


@dataclass(frozen=True)
class BatchPreset:
    """Batching settings that only make sense together: the step target, the batch and chunk bounds."""

    target_itl_ms: float | None       # None: steps are sized by max_num_batched_tokens alone
    max_num_seqs: int
    max_num_batched_tokens: int       # largest step, so largest prefill chunk
    min_prefill_chunk: int            # prefill tokens a step still takes when decodes alone miss the target


# Sized for a small model on a few CPU cores, where a 512-token chunk costs about a second; "gpu" for a
# GPU (the default there), where a step's cost hardly grows with its rows and prompt tokens come in bulk.
BATCH_PRESETS = {
    "latency": BatchPreset(target_itl_ms=100.0, max_num_seqs=16, max_num_batched_tokens=256, min_prefill_chunk=16),
    "balanced": BatchPreset(target_itl_ms=200.0, max_num_seqs=64, max_num_batched_tokens=512, min_prefill_chunk=32),
    "throughput": BatchPreset(target_itl_ms=None, max_num_seqs=128, max_num_batched_tokens=1024,
                              min_prefill_chunk=64),
    "gpu": BatchPreset(target_itl_ms=None, max_num_seqs=256, max_num_batched_tokens=8192, min_prefill_chunk=256),
}
DEFAULT_BATCH_PRESET = "balanced"


def default_batch_preset(device: str, offline: bool = False) -> str:
    """The preset used where none is named: gpu on a GPU; on the CPU, balanced for a server, throughput
    offline (nobody waits on each token there)."""
    if device.startswith("cuda"):
        return "gpu"
    return "throughput" if offline else DEFAULT_BATCH_PRESET
_BALANCED = BATCH_PRESETS[DEFAULT_BATCH_PRESET]


@dataclass(frozen=True)
class SchedulerConfig:
    """Defaults are the "balanced" preset; `from_preset` starts from another one."""

    max_num_seqs: int = _BALANCED.max_num_seqs
    max_num_batched_tokens: int = _BALANCED.max_num_batched_tokens
    max_model_len: int | None = None        # None = the model's own context length
    target_itl_ms: float | None = _BALANCED.target_itl_ms
    min_prefill_chunk: int = _BALANCED.min_prefill_chunk
    # A prompt longer than the threshold (None: max_num_batched_tokens, a prompt one step cannot take)
    # is "long": while others decode, its chunks may lengthen their step by at most this fraction of
    # the step's decode time, so its prefill never stalls the streams (None: no such cap). Only with a
    # target ITL, as the cap is a latency policy too.
    long_prefill_token_threshold: int | None = None
    long_prefill_max_slowdown: float | None = 1.0
    # With nothing decoding, a long prompt's chunk takes at most this many tokens, so a request that
    # arrives meanwhile waits for a shorter step than a whole max_num_batched_tokens one (None: no
    # cap). Only with a target ITL, as a latency policy.
    long_prefill_max_chunk: int | None = 256
    # Fair sharing: a tenant's share of admissions is proportional to its weight (default 1); a
    # tenant runs at most max_running_per_tenant requests at once (None = no cap).
    tenant_weights: tuple[tuple[str, float], ...] = ()
    max_running_per_tenant: int | None = None
    # A running request may be preempted for a better-priority waiting one at most this many times.
    max_priority_preemptions: int = 3

    @classmethod
    def from_preset(cls, batch_preset: str, **overrides: Any) -> SchedulerConfig:
        """The preset's values, with every given override winning over them."""
        if batch_preset not in BATCH_PRESETS:
            raise ValueError(f"batch_preset must be one of {', '.join(BATCH_PRESETS)}, got {batch_preset!r}")
        return cls(**{**dataclasses.asdict(BATCH_PRESETS[batch_preset]), **overrides})

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("min_prefill_chunk", self.min_prefill_chunk)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, allow_none=True)
        if self.long_prefill_max_slowdown is not None and (
            isinstance(self.long_prefill_max_slowdown, bool) or not isinstance(self.long_prefill_max_slowdown, (int, float))
            or not 0 < self.long_prefill_max_slowdown < float("inf")
        ):
            raise ValueError(f"long_prefill_max_slowdown must be a positive fraction of a step's decode time or "
                             f"None (off), got {self.long_prefill_max_slowdown!r}")
        _positive("long_prefill_max_chunk", self.long_prefill_max_chunk, allow_none=True)
        if self.target_itl_ms is not None and (
            isinstance(self.target_itl_ms, bool) or not isinstance(self.target_itl_ms, (int, float))
            or not 0 < self.target_itl_ms < float("inf")
        ):
            raise ValueError(f"target_itl_ms must be a positive number of milliseconds or None (off), "
                             f"got {self.target_itl_ms!r}")
        _positive("max_model_len", self.max_model_len, allow_none=True)
        _positive("max_running_per_tenant", self.max_running_per_tenant, allow_none=True)
        if isinstance(self.tenant_weights, dict):
            object.__setattr__(self, "tenant_weights", tuple(self.tenant_weights.items()))
        for tenant, weight in self.tenant_weights:
            if not isinstance(tenant, str) or isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                    or not 0 < weight < float("inf"):
                raise ValueError(f"tenant weights are positive numbers, got {tenant!r}: {weight!r}")
        if isinstance(self.max_priority_preemptions, bool) or not isinstance(self.max_priority_preemptions, int) \
                or self.max_priority_preemptions < 0:
            raise ValueError(f"max_priority_preemptions must be a non-negative integer, "
                             f"got {self.max_priority_preemptions!r}")

    @property
    def long_prefill_threshold(self) -> int:
        """Prompts with more tokens than this are long."""
        if self.long_prefill_token_threshold is None:
            return self.max_num_batched_tokens
        return self.long_prefill_token_threshold


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: decodes carry guessed tokens that the model verifies in the same step."""

    # None = off; "ngram": prompt lookup in the request's own context; "draft_model": a smaller model of
    # the same vocabulary guesses (speculative_model), implied when only the model is given
    speculative: str | None = None
    num_speculative_tokens: int = 4       # most guesses per decode
    ngram_prompt_lookup_min: int = 2      # shortest context tail looked up
    ngram_prompt_lookup_max: int = 4      # longest, tried first
    speculative_model: str | None = None  # the draft model's GGUF file or folder
    # the draft's weights: "auto" keeps a GGUF file's formats where the kernels run them
    speculative_model_quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.speculative_model_quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_model_quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.speculative_model_quantization!r}")
        if self.speculative is None and self.speculative_model is not None:
            object.__setattr__(self, "speculative", "draft_model")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} or None, "
                             f"got {self.speculative!r}")
        if self.speculative == "draft_model" and not self.speculative_model:
            raise ValueError("speculative 'draft_model' needs speculative_model: the draft model's file or folder")
        if self.speculative == "ngram" and self.speculative_model is not None:
            raise ValueError("speculative_model is the draft of method 'draft_model', not of 'ngram'")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("ngram_prompt_lookup_min", self.ngram_prompt_lookup_min)
        _positive("ngram_prompt_lookup_max", self.ngram_prompt_lookup_max)
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"ngram_prompt_lookup_min {self.ngram_prompt_lookup_min} exceeds "
                             f"ngram_prompt_lookup_max {self.ngram_prompt_lookup_max}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.cache.gpu_memory_utilization is None:
            return
        if not self.model.device.startswith("cuda"):   # refused rather than ignored
            raise ValueError("gpu_memory_utilization sizes the KV cache on a GPU: on the CPU give kv_cache_memory")
        if self.cache.kv_cache_memory is not None:
            raise ValueError("kv_cache_memory and gpu_memory_utilization both size the KV cache: give one")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Flat keyword options (as `LLM(**options)` or CLI flags give them) -> nested config.

        Unknown names raise TypeError, so a typo never silently does nothing. `batch_preset` picks
        the scheduler defaults (None: the device's, `default_batch_preset`); scheduler options given
        explicitly win over it.
        """
        batch_preset = options.pop("batch_preset", None) or default_batch_preset(str(options.get("device", "cpu")))
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "speculative": {}}
        owners = {
            f.name: part
            for part, klass in (("model", ModelConfig), ("cache", CacheConfig),
                                ("scheduler", SchedulerConfig), ("speculative", SpeculativeConfig))
            for f in dataclasses.fields(klass)
        }
        for name, value in options.items():
            if name not in owners:
                raise TypeError(f"unknown engine option {name!r}; known: {', '.join(sorted(owners))}")
            parts[owners[name]][name] = value
        return cls(ModelConfig(**parts["model"]), CacheConfig(**parts["cache"]),
                   SchedulerConfig.from_preset(batch_preset, **parts["scheduler"]),
                   SpeculativeConfig(**parts["speculative"]))


@dataclass(frozen=True)
class GrammarLimits:
    """What the server compiles of a request's structured-output constraint; past a limit, a 400 naming it."""

    max_bytes: int = 64 * 1024           # a schema's, grammar's or choice list's text
    max_choices: int = 1024              # guided_choice options; enum and const values in a schema
    max_regex_chars: int = 4096
    timeout_s: float = 10.0              # a compile still running after it is refused (it runs on, unwaited)
    max_concurrent_compiles: int = 2     # the threads compiling for the server; others wait for one
    cache_size: int = 1024               # specs whose verdict (compiles, or why not) is kept
    json_string_max_tokens: int | None = None   # JSON strings' closing quote forced after; None: 1024; 0: off

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "max_regex_chars", "max_concurrent_compiles", "cache_size"):
            _positive(name, getattr(self, name))
        _positive("json_string_max_tokens", self.json_string_max_tokens, allow_none=True, minimum=0)
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")


REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP server only; the engine never sees them."""

    host: str = "127.0.0.1"
    port: int = 8000                          # 0 = any free port
    api_key: str | None = None                # None = no key required
    max_waiting_requests: int | None = None   # beyond the free batch slots; past it 429; 0 = no queue; None = unbounded
    max_requests_per_tenant: int | None = None  # in flight (running or waiting) per tenant; past it 429; None = no limit
    state_dir: str | None = None              # where batch jobs and files live (SQLite); None = in memory
    responses_store: str | None = None        # stored responses (SQLite); None = under state_dir, or in memory
    shutdown_grace_s: float = 30.0            # after SIGTERM, before in-flight requests fail
    max_body_bytes: int = 8 * 1024 * 1024
    # Longest prompt text (characters, all prompts or messages of a request) tokenized; past it 413.
    # None: max_model_len times the longest token in characters, which no prompt that fits can pass.
    max_prompt_chars: int | None = None
    core_process: bool = True                 # the engine core in its own process, else on a server thread
    # Slow clients: a request's headers and its body must each arrive within their timeout, an idle
    # keep-alive connection is closed after its own. Past max_concurrency requests in progress
    # (streams included; /health and /metrics never count) new ones get 503; None = no cap.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_concurrency: int | None = None
    # A core that sends nothing for this long while it owes requests output is taken as stuck:
    # /health turns 503 and the requests in flight fail with a 503, until it steps again. 0 = off.
    core_stall_timeout_s: float = 30.0
    # The API key always guards /v1/*; /health stays open for probes. /metrics is open by default,
    # as vLLM leaves it, for scrapers; protect_metrics puts it behind the key. enable_docs False
    # removes /openapi.json and /docs (vLLM's --disable-fastapi-docs).
    protect_metrics: bool = False
    enable_docs: bool = True
    # The live view of the batch (/dashboard and its event stream); False removes it.
    enable_dashboard: bool = True
    # A "Running / Waiting / KV cache / throughput" line this often while there is work, as vLLM
    # prints; 0 = never (vLLM's --disable-log-stats).
    stats_log_interval_s: float = 10.0
    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    # How chat replies are read: a reasoning model's <think> part (vLLM's names: deepseek_r1, qwen3; None
    # = no split), and the tool-call syntax under tool_choice auto (auto = picked from the chat template).
    reasoning_parser: str | None = None
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port!r}")
        if self.max_waiting_requests is not None and (
            not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0
        ):
            raise ValueError(
                f"max_waiting_requests must be a non-negative integer, got {self.max_waiting_requests!r}"
            )
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")
        _positive("max_body_bytes", self.max_body_bytes)
        _positive("max_prompt_chars", self.max_prompt_chars, allow_none=True)
        _positive("max_concurrency", self.max_concurrency, allow_none=True)
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics needs an api_key to protect /metrics with")
        if not self.stats_log_interval_s >= 0:
            raise ValueError(f"stats_log_interval_s must be >= 0, got {self.stats_log_interval_s!r}")
        stall = self.core_stall_timeout_s
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 <= stall < float("inf"):
            raise ValueError(f"core_stall_timeout_s must be a number of seconds >= 0 (0 = off), got {stall!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
