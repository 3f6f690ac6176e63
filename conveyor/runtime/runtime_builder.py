"""build_runtime: what the engine core steps on (model, KV cache, runner, tensor-parallel ranks).

Every start-up choice is made here, once, and logged with its seconds: threads, C kernels,
quantization, dtype, the model length, the KV cache's size. `EngineCore` gets the result and is
left with its step loop and the requests' bookkeeping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor import kernels
from conveyor.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from conveyor.kernels.build import KernelLibrary
from conveyor.model.checkpoint import resolve_model_path
from conveyor.model.llama import LlamaModel, ModelArch
from conveyor.model.loader import keeps_on_device, load_model, resolve_quantization
from conveyor.runtime.cuda_graphs import DecodeGraphs
from conveyor.runtime.draft_model import DraftModelProposer, check_same_vocabulary
from conveyor.runtime.dtype import choose_dtype, choose_kv_dtype
from conveyor.runtime.kv.cache import KVCache, gpu_kv_budget, working_reserve
from conveyor.runtime.model_runner import ModelRunner, flex_block_size_ok, kernel_tile_size
from conveyor.runtime.tensor_parallel import TensorParallelRunner, load_rank0

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Runtime:
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    quantization: str
    kernel_library: KernelLibrary | None
    model: LlamaModel
    kv_cache: KVCache
    runner: ModelRunner                  # a TensorParallelRunner over its ranks when tensor_parallel_size > 1
    max_model_len: int
    num_threads: int                     # threads rank 0 computes with


def build_runtime(config: EngineConfig) -> Runtime:
    """Load the model and allocate its KV cache as the config says; raises ValueError for limits that cannot hold."""
    if config.model.seed is not None:
        torch.manual_seed(config.model.seed)   # the shared generator of unseeded requests
    num_threads = config.model.threads or kernels.threads.num_threads()
    torch.set_num_threads(num_threads)
    model_path = resolve_model_path(config.model.model)
    device = torch.device(config.model.device)
    phase_started = time.perf_counter()
    kernel_library = kernels.library() if device.type == "cpu" else None
    if device.type == "cpu":
        logger.info("start-up: C kernels %s in %.2f s", "ready" if kernel_library is not None
                    else "unavailable (torch kernels)", time.perf_counter() - phase_started)
    torch_layers = config.model.quantized_layers == "torch"
    quantization, (dtype, why), (kv_dtype, kv_why) = _formats(config, config.model.quantization, model_path, device,
                                                              kernel_library)
    logger.info("dtype %s (%s)", str(dtype).removeprefix("torch."), why)
    logger.info("KV cache dtype %s (%s)", str(kv_dtype).removeprefix("torch."), kv_why)
    tp = config.model.tensor_parallel_size
    if kv_dtype == torch.int8 and (device.type != "cpu" or tp > 1):
        raise ValueError("kv_cache_dtype int8 runs on the CPU in one process for now: not yet on "
                         f"{'a GPU' if device.type != 'cpu' else 'tensor_parallel_size > 1'}")
    comm, workers = None, []
    # The model phase: the loader logs it with its seconds.
    if tp > 1:   # the ranks share the cores: more threads each would spin on them
        num_threads = max(1, num_threads // tp)
        model, comm, workers = load_rank0(model_path, dtype, kernel_library, tp, num_threads)
    else:
        model = load_model(model_path, dtype, config.model.device, kernel_library, quantization,
                           torch_layers=torch_layers)
    if model.kernels is not None:
        # The layers run on the kernels' own thread pool; torch keeps only small ops (embedding,
        # sampling), and its OpenMP workers would spin beside the pool's after each of them.
        kernels.threads.set_num_threads(num_threads)
        torch.set_num_threads(1)
    arch = model.arch
    max_model_len = config.scheduler.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                         f"{arch.max_position_embeddings}")
    cache_cfg = config.cache
    kv_bytes = kv_cache_bytes(config, arch, device)
    num_blocks = cache_cfg.num_kv_blocks or KVCache.num_blocks_for(arch, cache_cfg.block_size, kv_dtype, kv_bytes)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory ({kv_bytes} bytes) is too small for one KV block "
                         f"({KVCache.bytes_per_block(arch, cache_cfg.block_size, kv_dtype)} bytes)")
    phase_started = time.perf_counter()
    use_graphs = device.type == "cuda" and not config.model.enforce_eager
    backend = attention_backend(config.model.attention_backend, device, cache_cfg.block_size)
    kv_cache = KVCache(arch, num_blocks, cache_cfg.block_size, kv_dtype, device,
                       transposed_keys=kernel_tile_size(model, cache_cfg.block_size, device, backend) > 0,
                       spare_block=use_graphs)
    logger.info("start-up: KV cache of %d blocks of %d tokens (%.2f GiB) allocated in %.2f s", num_blocks,
                cache_cfg.block_size, kv_cache.tensor.nbytes / 2**30, time.perf_counter() - phase_started)
    graphs = None
    if use_graphs:
        max_rows = config.scheduler.max_num_seqs
        graphs = DecodeGraphs(model, kv_cache, max_rows, -(-max_model_len // cache_cfg.block_size),
                              flex=backend == "flex")
        logger.info("start-up: decode steps of up to %d rows replay CUDA graphs, each captured on first use "
                    "(--enforce-eager: off)", max_rows)
    runner = (TensorParallelRunner(model, kv_cache, device, comm, workers) if comm is not None
              else ModelRunner(model, kv_cache, device, graphs, backend))
    if backend == "flex" and device.type == "cuda":
        logger.info("attention: FlexAttention reading the KV blocks in place (compiled at first use of each "
                    "shape class)")
    elif backend == "flex":
        logger.warning("attention: FlexAttention off a GPU scores every key of the KV cache for every query "
                       "(its reference semantics, for tests): slow with a large cache")
    return Runtime(model_path, device, dtype, quantization, kernel_library, model, kv_cache, runner,
                   max_model_len, num_threads)


def kv_cache_bytes(config: EngineConfig, arch: ModelArch, device: torch.device) -> int:
    """The memory given for the KV cache; on a GPU, where none is given, what the card's
    gpu_memory_utilization leaves once the weights (already loaded) and a step's working reserve count."""
    cache_cfg = config.cache
    if cache_cfg.kv_cache_memory is not None or device.type != "cuda":
        return cache_cfg.kv_cache_bytes
    free, total = torch.cuda.mem_get_info(device)
    reserve = working_reserve(arch, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    utilization = cache_cfg.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    budget = gpu_kv_budget(free, total, utilization, reserve)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} of the GPU's {total / 2**30:.1f} "
                         f"GiB leaves no room for a KV cache beside the {(total - free) / 2**30:.1f} GiB in use and "
                         f"a {reserve / 2**30:.1f} GiB working reserve: raise it, or give --kv-cache-memory")
    logger.info("start-up: KV cache sized from the GPU: %.2f of %.1f GiB, %.1f GiB in use, %.1f GiB reserved "
                "for a step", utilization, total / 2**30, (total - free) / 2**30, reserve / 2**30)
    return budget


def build_draft(config: EngineConfig, runtime: Runtime) -> DraftModelProposer:
    """The draft model of speculative decoding, beside `runtime`'s model: its own weights and KV cache
    (as many blocks as the model's, so it never runs out first), the same threads and device."""
    spec = config.speculative
    if config.model.tensor_parallel_size > 1:
        raise ValueError("a draft model runs beside one model, not tensor-parallel ranks")
    started = time.perf_counter()
    draft_path = resolve_model_path(spec.speculative_model)
    check_same_vocabulary(runtime.model_path, draft_path)
    device = runtime.device
    quantization, (dtype, _), (kv_dtype, _) = _formats(config, spec.speculative_model_quantization, draft_path,
                                                       device, runtime.kernel_library)
    model = load_model(draft_path, dtype, config.model.device, runtime.kernel_library, quantization,
                       torch_layers=config.model.quantized_layers == "torch")
    block_size = config.cache.block_size
    backend = attention_backend(config.model.attention_backend, device, block_size)
    kv_cache = KVCache(model.arch, runtime.kv_cache.num_blocks, block_size, kv_dtype, device,
                       transposed_keys=kernel_tile_size(model, block_size, device, backend) > 0)
    max_model_len = min(runtime.max_model_len, model.arch.max_position_embeddings)
    logger.info("start-up: draft model %s (%s, %s weights, KV cache of %d blocks) ready in %.2f s", draft_path,
                str(dtype).removeprefix("torch."), getattr(model, "weight_formats", None) or quantization,
                kv_cache.num_blocks, time.perf_counter() - started)
    return DraftModelProposer(ModelRunner(model, kv_cache, device, attention_backend=backend), max_model_len,
                              runtime.model.vocab_size)


def attention_backend(option: str, device: torch.device, block_size: int) -> str:
    """What `option` runs: "auto" is FlexAttention on a GPU where the block size lets it (a 0.5B model on
    an H200: 256 rows 16.3k -> 21.5k tok/s, one row's decode 2.84 -> 2.18 ms, BENCHMARKS.md), else the
    C kernel on the CPU or SDPA over gathered blocks."""
    if option == "auto" and device.type == "cuda" and flex_block_size_ok(block_size):
        return "flex"
    return option


def _formats(config: EngineConfig, option: str, path: Path, device: torch.device,
             kernel_library: KernelLibrary | None) -> tuple[str, tuple[torch.dtype, str], tuple[torch.dtype, str]]:
    """A model file's weights (quantization `option` resolved), working dtype and KV cache dtype, each
    dtype with why it was chosen: the same rules for the model and its draft."""
    torch_layers = config.model.quantized_layers == "torch"
    quantization = resolve_quantization(option, path, device.type, config.model.dtype, kernel_library,
                                        config.model.tensor_parallel_size, torch_layers)
    on_kernels = _on_kernels(quantization, device, torch_layers)
    dtype = choose_dtype(config.model.dtype, device, kernel_library, quantized=on_kernels)
    return quantization, dtype, choose_kv_dtype(config.cache.kv_cache_dtype, dtype[0], on_kernels)


def _on_kernels(quantization: str, device: torch.device, torch_layers: bool) -> bool:
    """Whether the weights run quantized on the C kernels (float32 activations, a float16 KV cache by
    default); torch's kept-quantized layers take the working dtype as float weights do."""
    return quantization != "none" and not keeps_on_device(quantization, device.type, torch_layers)


def log_batching(config: EngineConfig, with_proposer: bool) -> None:
    """The batching choices, as the scheduler will apply them, and speculative decoding's."""
    sched, spec = config.scheduler, config.speculative
    logger.info("batching: target ITL %s, max_num_seqs %d, max_num_batched_tokens %d, min_prefill_chunk %d, "
                "long prompts (over %d tokens) lengthen a decoding step by at most %s, step alone %s",
                "off" if sched.target_itl_ms is None else f"{sched.target_itl_ms:g} ms", sched.max_num_seqs,
                sched.max_num_batched_tokens, sched.min_prefill_chunk, sched.long_prefill_threshold,
                "(no cap)" if sched.long_prefill_max_slowdown is None or sched.target_itl_ms is None
                else f"{sched.long_prefill_max_slowdown:g}x its decode time",
                "up to the token budget" if sched.long_prefill_max_chunk is None or sched.target_itl_ms is None
                else f"at most {sched.long_prefill_max_chunk} tokens")
    if with_proposer:
        logger.info("speculative decoding: %s, up to %d draft tokens per decode%s", spec.speculative,
                    spec.num_speculative_tokens, f" from {spec.speculative_model}" if spec.speculative_model
                    else f", n-grams {spec.ngram_prompt_lookup_min}..{spec.ngram_prompt_lookup_max}")
