"""Models with weights kept quantized: a tiny GGUF with Q8_0 / Q4_0 / Q4_1 tensors loads without
dequantizing, stands for exactly the file's weights, tracks the float model's logits and greedy
tokens, and gives each row the same bits alone or in a batch (also for int8 from a float checkpoint)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor import kernels
from conveyor.kernels import gemm, quant
from conveyor.model.attention import RowSpec, build_metadata
from conveyor.model.llama import LlamaModel
from conveyor.model.loader import load_model
from conveyor.model.quant import QuantEmbedding, QuantLinear
from conveyor.runtime.kv.cache import KVCache
from conveyor.runtime.model_runner import kernel_tile_size

from gguf_blocks import llama_layer_shapes, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(kernels.library() is None, reason="no C compiler")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 320
BLOCK_SIZE = 16
# Every supported type in use, fused groups included: q/k/v Q8_0, gate/up Q4_1, the rest Q4_0.
TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0"}
# The K-quants, Q5_0 and Q5_1, mixed inside the fused q/k/v and gate/up as Q4_K_M files mix them, and one
# type without a kernel (TQ2_0, requantized to Q8_0); K = 256 and 512, multiples of the K-quants' 256.
K_HIDDEN, K_FFN = 256, 512
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
           "ffn_gate": "Q4_K", "ffn_up": "Q6_K", "ffn_down": "Q5_K"}


def write_tiny_gguf(path: Path, hidden: int, ffn: int, types: dict[str, str], embed_type: str,
                    output_type: str | None = None, overrides: dict[str, str] | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)

    def add(name: str, shape: tuple[int, ...], kind: str = "F32", scale: float = 0.2) -> None:
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind.endswith("_K"):
            raw = random_blocks(kind.lower(), shape[0], shape[1], seed=int(rng.integers(1 << 30)), scale=scale)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            return
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w + (1.0 if name.endswith("norm.weight") else 0.0))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, hidden), embed_type, scale=1.0)
    if output_type is not None:
        add("output.weight", (VOCAB, hidden), output_type)
    add("output_norm.weight", (hidden,))
    shapes = llama_layer_shapes(hidden, ffn, HEADS, KV_HEADS)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        for kind, shape in shapes.items():
            name = f"blk.{i}.{kind}.weight"
            add(name, shape, (overrides or {}).get(name, types[kind]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("quant") / "tiny.gguf", HIDDEN, FFN, TYPES, "Q8_0")


@pytest.fixture(scope="module")
def tiny_kquant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("kquant") / "tiny-k.gguf", K_HIDDEN, K_FFN, K_TYPES, "Q6_K",
                           output_type="Q8_0", overrides={"blk.1.ffn_up.weight": "TQ2_0",
                                                                  "blk.0.attn_output.weight": "Q5_1"})


def _load(path: Path, quantization: str) -> LlamaModel:
    return load_model(path, kernel_library=kernels.library(), quantization=quantization)


def _forward(model: LlamaModel, cache: KVCache, rows: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
    """One packed step; rows are (new token ids, tokens already cached, block table)."""
    input_ids, positions, specs = [], [], []
    for tokens, cached, table in rows:
        specs.append(RowSpec(token_start=len(input_ids), num_query=len(tokens),
                             context_len=cached + len(tokens), block_table=table))
        input_ids += tokens
        positions += range(cached, cached + len(tokens))
    meta = build_metadata(specs, block_size=BLOCK_SIZE, sliding_window=None, device=torch.device("cpu"),
                          kernel_tile_size=_tile(model))
    with torch.no_grad():
        logits = model(torch.tensor(input_ids), torch.tensor(positions), meta, cache.layers,
                       torch.arange(len(input_ids)))
    return list(logits.split([len(t) for t, _, _ in rows]))


def _tile(model: LlamaModel) -> int:
    return kernel_tile_size(model, BLOCK_SIZE, torch.device("cpu"))


def _cache(model: LlamaModel, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(model.arch, num_blocks=64, block_size=BLOCK_SIZE, dtype=dtype, transposed_keys=_tile(model) > 0)


def _greedy(model: LlamaModel, prompts: list[list[int]], steps: int,
            kv_dtype: torch.dtype = torch.float32) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts in one batch, then decode them together; tokens and every step's logits."""
    cache = _cache(model, kv_dtype)
    per_row = math.ceil((max(map(len, prompts)) + steps) / BLOCK_SIZE)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(len(prompts))]
    out = _forward(model, cache, [(p, 0, t) for p, t in zip(prompts, tables)])
    logits = [o[-1:] for o in out]
    tokens = [[int(o[-1].argmax())] for o in out]
    for _ in range(steps - 1):
        out = _forward(model, cache, [([tok[-1]], len(p) + len(tok) - 1, t)
                                      for p, tok, t in zip(prompts, tokens, tables)])
        for i, o in enumerate(out):
            logits[i] = torch.cat([logits[i], o])
            tokens[i].append(int(o[-1].argmax()))
    return tokens, logits


PROMPTS = [[5, 17, 33, 250, 8, 99, 100, 7, 64, 3, 12, 200], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301]]


def test_gguf_tensors_stay_quantized_and_equal_the_file(tiny_gguf: Path) -> None:
    floats, kept = _load(tiny_gguf, "none"), _load(tiny_gguf, "gguf")
    layer = kept.layers[0]
    formats = {"self_attn.qkv_proj": "q8_0", "self_attn.o_proj": "q4_0", "mlp.gate_up_proj": "q4_1",
               "mlp.down_proj": "q4_0"}
    for name, fmt in formats.items():
        module = layer.get_submodule(name)
        assert isinstance(module, QuantLinear) and {w.fmt for w in module.weights} == {fmt}
        packed = floats.layers[0].get_submodule(name)
        # Same values as the dequantized file, after the q/k row un-permutation; fused parts are segments.
        weight = torch.cat([quant.dequantize(w) for w in module.weights])
        assert torch.equal(weight, gemm.unpack(packed.packed, packed.out_features))
    assert isinstance(kept.lm_head, QuantLinear) and kept.lm_head.weight.fmt == "q8_0"
    assert torch.equal(quant.dequantize(kept.lm_head.weight), floats.embed_tokens.weight)
    # The embedding stays in the file's blocks; a lookup gives the dequantized rows.
    assert isinstance(kept.embed_tokens, QuantEmbedding)
    ids = torch.tensor([0, 5, 300, 5])
    assert torch.equal(kept.embed_tokens(ids), floats.embed_tokens(ids))
    weight_bytes = sum(b.numel() for b in kept.buffers())
    float_bytes = sum(p.numel() * 4 for n, p in floats.named_parameters() if "packed" in n)
    assert weight_bytes < float_bytes / 3


def _agreement(floats: LlamaModel, other: LlamaModel) -> tuple[float, float]:
    """Teacher-forced over the float model's greedy continuations: (top-1 agreement, relative rms error)."""
    tokens, _ = _greedy(floats, PROMPTS, steps=8)
    sequences = [p + t for p, t in zip(PROMPTS, tokens)]
    cache_f, cache_o = _cache(floats), _cache(other)
    rows = [(s, 0, list(range(i * 2, i * 2 + 2))) for i, s in enumerate(sequences)]
    ref, ours = torch.cat(_forward(floats, cache_f, rows)), torch.cat(_forward(other, cache_o, rows))
    agree = (ref.argmax(-1) == ours.argmax(-1)).float().mean().item()
    return agree, ((ref - ours).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


@pytest.mark.parametrize("source", ["gguf", "kquant"])
def test_kept_quantized_tracks_the_float_model(tiny_gguf: Path, tiny_kquant_gguf: Path, source: str) -> None:
    # The weights are the same values; only the activations' int8 rounding separates the two.
    path = tiny_gguf if source == "gguf" else tiny_kquant_gguf
    agree, rms = _agreement(_load(path, "none"), _load(path, "auto"))
    assert agree >= 0.9 and rms <= 0.05, (agree, rms)


def test_kquant_file_keeps_each_format_as_a_segment(tiny_kquant_gguf: Path) -> None:
    floats, kept = _load(tiny_kquant_gguf, "none"), _load(tiny_kquant_gguf, "auto")
    for i, layer in enumerate(kept.layers):
        formats = {name: [w.fmt for w in layer.get_submodule(name).weights]
                   for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
        assert formats == {"self_attn.qkv_proj": ["q4_k", "q5_k", "q6_k"],
                           "self_attn.o_proj": ["q5_1" if i == 0 else "q5_0"],
                           "mlp.gate_up_proj": ["q4_k", "q6_k" if i == 0 else "q8_0"], "mlp.down_proj": ["q5_k"]}
        assert layer.fused is not None   # the whole layer still runs as one C call
    assert [w.fmt for w in kept.lm_head.weights] == ["q8_0"]
    ids = torch.tensor([3, 0, 319, 3])
    assert isinstance(kept.embed_tokens, QuantEmbedding) and torch.equal(kept.embed_tokens(ids), floats.embed_tokens(ids))


@pytest.mark.parametrize("source,quantization", [("gguf", "gguf"), ("kquant", "auto"), ("hf", "int8"),
                                                 ("gguf", "int8")])
def test_batched_equals_alone(tiny_gguf: Path, tiny_kquant_gguf: Path, tiny_llama: Path, source: str,
                              quantization: str) -> None:
    model = _load({"gguf": tiny_gguf, "kquant": tiny_kquant_gguf, "hf": tiny_llama}[source], quantization)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    batched_tokens, batched_logits = _greedy(model, PROMPTS, steps=6)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = _greedy(model, [prompt], steps=6)
        assert tokens[0] == batched_tokens[i]
        assert torch.equal(logits[0], batched_logits[i]), f"prompt {i}: batched logits differ from alone"


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_tracks_float32_and_batched_equals_alone(tiny_kquant_gguf: Path, kv_dtype: torch.dtype) -> None:
    """The fused layer writes its keys and values rounded to the cache's dtype and attention widens them:
    the first token's logits (the same inputs) move by the cache's rounding alone on float weights, and
    by less than the int8 activations already move them on quantized ones."""
    floats, kept = _load(tiny_kquant_gguf, "none"), _load(tiny_kquant_gguf, "auto")
    assert all(layer.fused is not None for model in (floats, kept) for layer in model.layers)

    def first_logits(model: LlamaModel, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([logits[:1] for logits in _greedy(model, PROMPTS, steps=1, kv_dtype=dtype)[1]])

    def rms(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).pow(2).mean() / a.pow(2).mean()).sqrt().item()

    reference = first_logits(floats, torch.float32)
    assert 0 < rms(reference, first_logits(floats, kv_dtype)) < (1e-3 if kv_dtype == torch.float16 else 5e-3)
    assert rms(reference, first_logits(kept, kv_dtype)) < 1.5 * rms(reference, first_logits(kept, torch.float32))
    batched_tokens, batched_logits = _greedy(kept, PROMPTS, steps=6, kv_dtype=kv_dtype)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = _greedy(kept, [prompt], steps=6, kv_dtype=kv_dtype)
        assert tokens[0] == batched_tokens[i] and torch.equal(logits[0], batched_logits[i]), f"prompt {i}"


def test_the_portable_build_keeps_a_float16_cache_as_the_native_one(tiny_kquant_gguf: Path) -> None:
    """Without F16C the conversions are plain C (tests/model/test_attention_kernel.py checks them bit for bit)."""
    portable = kernels.library_for(frozenset())
    native = _greedy(_load(tiny_kquant_gguf, "none"), PROMPTS, steps=4, kv_dtype=torch.float16)
    plain = _greedy(load_model(tiny_kquant_gguf, kernel_library=portable, quantization="none"), PROMPTS, steps=4,
                    kv_dtype=torch.float16)
    assert plain[0] == native[0]
    for a, b in zip(plain[1], native[1]):   # rows summed in other widths round to float16 apart now and then
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_int8_from_float_checkpoint_is_close(tiny_llama: Path) -> None:
    floats, int8 = _load(tiny_llama, "none"), _load(tiny_llama, "int8")
    assert isinstance(int8.lm_head, QuantLinear) and isinstance(int8.layers[0].mlp.down_proj, QuantLinear)
    agree, rms = _agreement(floats, int8)
    assert agree >= 0.9 and rms <= 0.05, (agree, rms)


def test_gguf_quantization_needs_a_gguf_file(tiny_llama: Path) -> None:
    from conveyor.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="int8"):
        _load(tiny_llama, "gguf")


@pytest.mark.parametrize("source", ["tied", "output"])
def test_the_head_in_the_layers_call_gives_the_same_bits(tiny_gguf: Path, tiny_kquant_gguf: Path, source: str) -> None:
    """The final norm and a quantized output layer run inside the layers' C call (decoder_step) or after it
    from Python: the same logits, bit for bit, for the rows a step scores (a subset, out of order)."""
    model = _load(tiny_gguf if source == "tied" else tiny_kquant_gguf, "gguf")
    assert model._fused_head() is not None
    caches = [_cache(model), _cache(model)]
    rows = [(PROMPTS[0], 0, [0]), (PROMPTS[1], 0, [1]), (PROMPTS[2], 0, [2])]
    scored = torch.tensor([23, 0, 11, 12])
    outputs = []
    for fused, cache in zip((True, False), caches):
        if not fused:
            model._fused_head = lambda: None   # the instance's attribute shadows the method
        input_ids, positions, specs = [], [], []
        for tokens, cached, table in rows:
            specs.append(RowSpec(token_start=len(input_ids), num_query=len(tokens), context_len=len(tokens),
                                 block_table=table))
            input_ids += tokens
            positions += range(len(tokens))
        meta = build_metadata(specs, block_size=BLOCK_SIZE, sliding_window=None, device=torch.device("cpu"),
                              kernel_tile_size=_tile(model))
        with torch.no_grad():
            outputs.append(model(torch.tensor(input_ids), torch.tensor(positions), meta, cache.layers, scored))
        decode = build_metadata([RowSpec(token_start=0, num_query=1, context_len=13, block_table=[0])],
                                block_size=BLOCK_SIZE, sliding_window=None, device=torch.device("cpu"),
                                kernel_tile_size=_tile(model))
        with torch.no_grad():
            outputs.append(model(torch.tensor([77]), torch.tensor([12]), meta=decode, kv_caches=cache.layers,
                                 logits_indices=torch.tensor([0])))
    del model._fused_head
    assert outputs[0].shape == (4, VOCAB) and outputs[1].shape == (1, VOCAB)
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
    with pytest.raises(ValueError, match="refused"), torch.no_grad():   # a row past the step's tokens
        model(torch.tensor([77]), torch.tensor([13]), meta=decode, kv_caches=caches[0].layers,
              logits_indices=torch.tensor([1]))
