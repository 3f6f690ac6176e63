"""Batch presets: what each sets, explicit options and flags winning over them, validation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conveyor.cli.flags import build_parser, engine_options
from conveyor.config import BATCH_PRESETS, CacheConfig, EngineConfig, SchedulerConfig, default_batch_preset
from conveyor.runtime.kv.cache import gpu_kv_budget, working_reserve


def scheduler_from_flags(*flags: str) -> SchedulerConfig:
    return EngineConfig.from_options(**engine_options(build_parser().parse_args(["serve", *flags]))).scheduler


def test_defaults_are_the_balanced_preset() -> None:
    assert SchedulerConfig() == SchedulerConfig.from_preset("balanced")
    assert EngineConfig.from_options().scheduler == SchedulerConfig()
    assert scheduler_from_flags() == SchedulerConfig()
    assert SchedulerConfig().target_itl_ms == 200.0


@pytest.mark.parametrize("name", list(BATCH_PRESETS))
def test_a_preset_sets_target_batch_and_chunk_bounds_together(name: str) -> None:
    preset = BATCH_PRESETS[name]
    for config in (SchedulerConfig.from_preset(name), EngineConfig.from_options(batch_preset=name).scheduler,
                   scheduler_from_flags("--batch-preset", name)):
        assert (config.target_itl_ms, config.max_num_seqs, config.max_num_batched_tokens,
                config.min_prefill_chunk) == (preset.target_itl_ms, preset.max_num_seqs,
                                              preset.max_num_batched_tokens, preset.min_prefill_chunk)


def test_presets_go_from_short_steps_to_large_ones() -> None:
    latency, balanced, throughput = (BATCH_PRESETS[n] for n in ("latency", "balanced", "throughput"))
    assert latency.target_itl_ms < balanced.target_itl_ms and throughput.target_itl_ms is None
    assert latency.max_num_seqs < balanced.max_num_seqs < throughput.max_num_seqs
    assert latency.max_num_batched_tokens < balanced.max_num_batched_tokens < throughput.max_num_batched_tokens


def test_explicit_options_win_over_the_preset() -> None:
    config = EngineConfig.from_options(batch_preset="throughput", max_num_seqs=3, target_itl_ms=150.0).scheduler
    assert (config.max_num_seqs, config.target_itl_ms) == (3, 150.0)
    assert config.max_num_batched_tokens == BATCH_PRESETS["throughput"].max_num_batched_tokens
    config = EngineConfig.from_options(batch_preset="latency", target_itl_ms=None).scheduler
    assert config.target_itl_ms is None and config.max_num_seqs == BATCH_PRESETS["latency"].max_num_seqs


def test_explicit_flags_win_over_the_preset_and_zero_turns_the_target_off() -> None:
    config = scheduler_from_flags("--batch-preset", "latency", "--max-num-batched-tokens", "100",
                                  "--max-num-seqs", "5", "--min-prefill-chunk", "8", "--target-itl-ms", "0")
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.min_prefill_chunk) == (100, 5, 8)
    assert config.target_itl_ms is None
    config = scheduler_from_flags("--batch-preset", "throughput", "--target-itl-ms", "250")
    assert config.target_itl_ms == 250.0 and config.max_num_seqs == BATCH_PRESETS["throughput"].max_num_seqs
    assert scheduler_from_flags("--long-prefill-max-chunk", "128").long_prefill_max_chunk == 128
    assert scheduler_from_flags("--long-prefill-max-chunk", "0").long_prefill_max_chunk is None


@pytest.mark.parametrize("options, field", [
    (dict(batch_preset="fastest"), "batch_preset"),
    (dict(target_itl_ms=0), "target_itl_ms"),
    (dict(target_itl_ms=-5.0), "target_itl_ms"),
    (dict(target_itl_ms=float("nan")), "target_itl_ms"),
    (dict(target_itl_ms=True), "target_itl_ms"),
    (dict(min_prefill_chunk=0), "min_prefill_chunk"),
    (dict(long_prefill_max_chunk=0), "long_prefill_max_chunk"),
    (dict(long_prefill_max_chunk=1.5), "long_prefill_max_chunk"),
])
def test_bad_values_are_refused_by_name(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_options(**options)


def test_an_unknown_preset_flag_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--batch-preset", "fastest"])


def test_a_gpu_picks_the_gpu_preset_unless_one_is_named() -> None:
    assert default_batch_preset("cuda") == default_batch_preset("cuda:1", offline=True) == "gpu"
    assert (default_batch_preset("cpu"), default_batch_preset("cpu", offline=True)) == ("balanced", "throughput")
    assert EngineConfig.from_options(device="cuda").scheduler == SchedulerConfig.from_preset("gpu")
    assert scheduler_from_flags("--device", "cuda") == SchedulerConfig.from_preset("gpu")
    assert scheduler_from_flags("--device", "cuda", "--batch-preset", "latency") == SchedulerConfig.from_preset("latency")
    assert scheduler_from_flags("--device", "cuda", "--max-num-seqs", "32").max_num_seqs == 32
    gpu = BATCH_PRESETS["gpu"]
    assert gpu.max_num_batched_tokens > BATCH_PRESETS["throughput"].max_num_batched_tokens and gpu.target_itl_ms is None


def test_kv_memory_on_a_gpu_is_what_the_utilization_leaves() -> None:
    arch = SimpleNamespace(intermediate_size=1536, vocab_size=49152)   # the bundled model's
    assert CacheConfig().kv_cache_memory is None and CacheConfig().kv_cache_bytes == 2 * 2**30   # the CPU's default
    assert EngineConfig.from_options(kv_cache_memory="3GiB").cache.kv_cache_bytes == 3 * 2**30
    reserve = working_reserve(arch, 8192, 256)
    assert reserve > 2**30 + 256 * arch.vocab_size * 4   # the sampled rows' logits at least
    gib = 2**30
    # 80 GiB card, 10 GiB held (weights, another process): 0.9 leaves 72 - 10 - reserve
    assert gpu_kv_budget(70 * gib, 80 * gib, 0.9, reserve) == int(80 * gib * 0.9) - 10 * gib - reserve
    assert gpu_kv_budget(5 * gib, 80 * gib, 0.5, reserve) < 0   # nothing left: start-up refuses (runtime_builder)
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    assert EngineConfig.from_options(**engine_options(build_parser().parse_args(
        ["serve", "--device", "cuda", "--gpu-memory-utilization", "0.5"]))).cache.gpu_memory_utilization == 0.5
    assert EngineConfig.from_options(device="cuda").cache.gpu_memory_utilization is None   # 0.9 where it is used


@pytest.mark.parametrize("options, message", [
    (dict(gpu_memory_utilization=0.5), "on the CPU give kv_cache_memory"),
    (dict(device="cuda", gpu_memory_utilization=0.5, kv_cache_memory="4GiB"), "give one"),
])
def test_gpu_memory_utilization_is_refused_where_it_would_be_ignored(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_auto_attention_is_flex_on_a_gpu_where_the_block_size_lets_it() -> None:
    from conveyor.runtime.runtime_builder import attention_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attention_backend("auto", cuda, 16) == attention_backend("auto", cuda, 64) == "flex"
    assert attention_backend("auto", cuda, 24) == "auto" and attention_backend("auto", cuda, 8) == "auto"
    assert attention_backend("auto", cpu, 16) == "auto"
    assert attention_backend("sdpa", cuda, 16) == "sdpa" and attention_backend("flex", cpu, 16) == "flex"
