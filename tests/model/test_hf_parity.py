"""Our packed, paged forward against transformers' per-sequence forward on tiny random checkpoints.

Every comparison is float32 logits: one packed prefill of several rows, decode steps through the
KV cache, a step that mixes a decode row with a prefill chunk, and a prompt prefilled in two chunks.
Block tables are drawn from a shuffled pool (block 0 included), so rows' blocks are neither
contiguous nor ascending, as they are after a running engine has freed and reused blocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conveyor import kernels
from conveyor.model.attention import RowSpec, build_metadata
from conveyor.model.llama import LlamaModel
from conveyor.model.loader import load_model
from conveyor.runtime.kv.cache import KVCache

MODEL_NAMES = ("llama", "llama_untied", "qwen2", "qwen3", "phi3", "mistral", "gemma3", "gemma3_scaled")
# The torch ops, and the C kernels (packed matmuls, each decoder layer as one C call, paged attention).
PATHS = ("torch", "kernels") if kernels.library() is not None else ("torch",)
BLOCK_SIZE = 16
NUM_BLOCKS = 32
PROMPT_LENS = (5, 13, 1, 21)     # one token, one block, past one block; 13 and 21 exceed Mistral's window of 8
NUM_DECODE_STEPS = 4
REL_TOL = 1e-4                   # absolute tolerance as a fraction of the largest reference logit


class PagedRunner:
    """Our model plus a KV cache, with block tables handed out from a shuffled free pool."""

    def __init__(self, model: LlamaModel, seed: int = 0) -> None:
        self.model = model
        arch = model.arch
        self.kernel_tile_size = (kernels.attention_tile_size(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                             BLOCK_SIZE)
                                 if model.kernels is not None else 0)
        self.cache = KVCache(model.arch, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                             dtype=model.embed_tokens.weight.dtype, transposed_keys=self.kernel_tile_size > 0)
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)

    def allocate(self, num_tokens: int) -> list[int]:
        num_blocks = math.ceil(num_tokens / BLOCK_SIZE)
        table, self.free_blocks = self.free_blocks[:num_blocks], self.free_blocks[num_blocks:]
        assert len(table) == num_blocks, "test pool exhausted"
        return table

    def step(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """One packed forward. chunks: (new token ids, tokens already cached, block table) per row.

        Returns each row's logits for all its new tokens, (num_new, V).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[RowSpec] = []
        for tokens, num_cached, table in chunks:
            context_len = num_cached + len(tokens)
            assert len(table) >= math.ceil(context_len / BLOCK_SIZE)
            rows.append(RowSpec(token_start=len(input_ids), num_query=len(tokens),
                                context_len=context_len, block_table=table))
            input_ids.extend(tokens)
            positions.extend(range(num_cached, context_len))
        meta = build_metadata(rows, block_size=BLOCK_SIZE, sliding_window=self.model.arch.sliding_window,
                              device=torch.device("cpu"), kernel_tile_size=self.kernel_tile_size)
        num_tokens = len(input_ids)
        with torch.no_grad():
            logits = self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.cache.layers,
                                torch.arange(num_tokens))                              # (T, V)
        assert logits.shape == (num_tokens, self.model.arch.vocab_size) and logits.dtype == torch.float32
        return list(logits.split([len(tokens) for tokens, _, _ in chunks]))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol = REL_TOL * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert err <= atol, f"{what}: max |ours - transformers| = {err:.3g} > {atol:.3g}"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and spinning threads crawl when the cores are shared."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module", params=[(m, p) for m in MODEL_NAMES for p in PATHS],
                ids=lambda param: "-".join(param))
def models(request: pytest.FixtureRequest,
           tiny_checkpoint_factory: Callable[[str], Path]) -> tuple[str, LlamaModel, torch.nn.Module]:
    """(name, our model, transformers' model) for one tiny checkpoint, both float32."""
    from transformers import AutoModelForCausalLM

    name, path = request.param
    folder = tiny_checkpoint_factory(name)
    ours = load_model(folder, torch.float32, kernel_library=kernels.library() if path == "kernels" else None)
    # eager attention applies Mistral's sliding window in the plainest way.
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return name, ours, hf


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for one whole sequence, (len(tokens), V)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


def random_tokens(vocab_size: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def test_checkpoint_features_are_loaded(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    """The tiny checkpoints exercise what they are meant to, so the parity tests below are not vacuous."""
    name, ours, hf = models
    arch = ours.arch
    assert arch.tie_word_embeddings == (name in ("llama", "qwen2", "qwen3", "gemma3"))
    assert arch.qk_norm == (name in ("qwen3", "gemma3", "gemma3_scaled"))
    assert arch.rope_dim == (12 if name == "phi3" else arch.head_dim)
    if name == "qwen3":   # a head_dim that is not hidden / heads, and norms that are not all ones
        assert arch.head_dim == 32 != arch.hidden_size // arch.num_heads
        assert ours.layers[0].self_attn.k_norm.weight.std() > 0.05
    if ours.kernels is None:   # with kernels a tied output layer gets a packed copy
        assert (ours.lm_head is None) == arch.tie_word_embeddings
    else:   # every layer in one C call, Phi-3's partial RoPE included
        assert ours.fused_layers
    if name == "qwen2":
        bias = ours.layers[0].self_attn.qkv_proj.bias
        assert arch.qkv_bias and bias is not None and bias.abs().min() > 0
    if name == "mistral":
        assert arch.sliding_window == 8 and all(arch.sliding_layers)
    elif name.startswith("gemma3"):
        text = hf.config
        assert arch.sliding_layers == tuple(t == "sliding_attention" for t in text.layer_types)
        assert arch.sliding_window == text.sliding_window and any(arch.sliding_layers) and not all(arch.sliding_layers)
        assert ours.layers[0].self_attn.scale == text.query_pre_attn_scalar ** -0.5
        rope = hf.model.rotary_emb
        torch.testing.assert_close(ours.rotary_local.inv_freq, rope.sliding_attention_inv_freq.float())
        torch.testing.assert_close(ours.rotary.inv_freq, rope.full_attention_inv_freq.float())
        assert not torch.equal(ours.rotary.inv_freq, ours.rotary_local.inv_freq)
        # Norms are held as multipliers: transformers' stored weight + 1.
        torch.testing.assert_close(ours.layers[1].post_feedforward_layernorm.weight,
                                   hf.model.layers[1].post_feedforward_layernorm.weight + 1)
        return
    else:
        assert arch.sliding_window is None and not any(arch.sliding_layers)
    if name == "llama_untied":
        assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "llama3"
    assert arch.rope_theta == hf.config.rope_parameters["rope_theta"]
    torch.testing.assert_close(ours.rotary.inv_freq, hf.model.rotary_emb.inv_freq.float())


def test_mistral_window_changes_logits(tiny_mistral: Path) -> None:
    """Guard against a vacuous window test: past 8 tokens, windowed logits differ from full attention."""
    from transformers import AutoModelForCausalLM

    windowed = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    full = AutoModelForCausalLM.from_pretrained(tiny_mistral, dtype=torch.float32, attn_implementation="eager",
                                                sliding_window=None).eval()
    (tokens,) = random_tokens(windowed.config.vocab_size, (21,), seed=7)
    a, b = hf_logits(windowed, tokens), hf_logits(full, tokens)
    torch.testing.assert_close(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().max() > 1e-2


def test_packed_prefill_then_decode_match_transformers(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    name, ours, hf = models
    runner = PagedRunner(ours, seed=1)
    prompts = random_tokens(ours.arch.vocab_size, PROMPT_LENS, seed=11)
    continuations = random_tokens(ours.arch.vocab_size, (NUM_DECODE_STEPS,) * len(prompts), seed=12)
    tables = [runner.allocate(len(p) + NUM_DECODE_STEPS) for p in prompts]

    # One forward prefills every prompt; the 1-token prompt lands in the decode group.
    prefill = runner.step([(p, 0, table) for p, table in zip(prompts, tables)])
    for i, (prompt, logits) in enumerate(zip(prompts, prefill)):
        assert_logits_close(logits, hf_logits(hf, prompt), f"{name} prefill row {i} (len {len(prompt)})")

    sequences = [list(p) for p in prompts]
    for step in range(NUM_DECODE_STEPS):
        decode = runner.step([([cont[step]], len(seq), table)
                              for seq, cont, table in zip(sequences, continuations, tables)])
        for i, (seq, cont, logits) in enumerate(zip(sequences, continuations, decode)):
            seq.append(cont[step])
            assert_logits_close(logits[0], hf_logits(hf, seq)[-1],
                                f"{name} decode step {step} row {i} (context {len(seq)})")


def test_decode_and_prefill_chunk_in_one_step(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    """Row a decodes while row b prefills its second chunk and row c its whole prompt, in one forward."""
    name, ours, hf = models
    runner = PagedRunner(ours, seed=2)
    a, b, c = random_tokens(ours.arch.vocab_size, (14, 23, 9), seed=21)
    table_a, table_b, table_c = runner.allocate(len(a)), runner.allocate(len(b)), runner.allocate(len(c))

    first = runner.step([(a[:13], 0, table_a), (b[:10], 0, table_b)])
    assert_logits_close(first[0], hf_logits(hf, a[:13]), f"{name} step 1 row a")
    assert_logits_close(first[1], hf_logits(hf, b[:10]), f"{name} step 1 row b chunk 1")

    second = runner.step([(a[13:], 13, table_a), (b[10:], 10, table_b), (c, 0, table_c)])
    assert_logits_close(second[0][0], hf_logits(hf, a)[-1], f"{name} step 2 row a decode")
    assert_logits_close(second[1], hf_logits(hf, b)[10:], f"{name} step 2 row b chunk 2")
    assert_logits_close(second[2], hf_logits(hf, c), f"{name} step 2 row c prefill")


def test_chunked_prefill_matches_one_shot(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    """A prompt split at a non-block-aligned point gives the one-shot logits; chunk 2 crosses a block."""
    name, ours, hf = models
    (prompt,) = random_tokens(ours.arch.vocab_size, (29,), seed=31)
    split = 7

    one_shot_runner = PagedRunner(ours, seed=3)
    (one_shot,) = one_shot_runner.step([(prompt, 0, one_shot_runner.allocate(len(prompt)))])

    runner = PagedRunner(ours, seed=4)
    table = runner.allocate(len(prompt))
    (chunk_1,) = runner.step([(prompt[:split], 0, table)])
    (chunk_2,) = runner.step([(prompt[split:], split, table)])
    chunked = torch.cat([chunk_1, chunk_2])

    assert_logits_close(chunked, one_shot, f"{name} chunked vs one-shot")
    assert_logits_close(chunked, hf_logits(hf, prompt), f"{name} chunked vs transformers")


def test_the_head_in_the_layers_call_gives_the_same_bits(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    """With the C kernels the final norm and the packed output layer run inside the layers' call
    (decoder_step) where the model's parts allow it: the logits equal those of the head run after it."""
    name, ours, _ = models
    if ours.kernels is None:
        pytest.skip("the torch path has no layers' call")
    tokens = random_tokens(ours.arch.vocab_size, (9, 4), seed=31)
    logits = []
    for fused in (True, False):
        runner = PagedRunner(ours, seed=3)
        if not fused:
            ours._fused_head = lambda: None   # the instance's attribute shadows the method
        try:
            tables = [runner.allocate(16), runner.allocate(16)]
            logits += runner.step([(tokens[0], 0, tables[0]), (tokens[1], 0, tables[1])])
            logits += runner.step([(tokens[1][:1], 9, tables[0]), (tokens[0][:2], 4, tables[1])])
        finally:
            ours.__dict__.pop("_fused_head", None)
    assert (ours._fused_head() is None) == (name.startswith("gemma3") or not ours.fused_layers)
    for a, b in zip(logits[:4], logits[4:]):
        assert torch.equal(a, b), name


def test_rope_rows_looked_up_by_position_give_the_same_bits(models: tuple[str, LlamaModel, torch.nn.Module]) -> None:
    """The layers' C call turns each token with its row of the whole RoPE tables, looked up by position,
    or with the step's rows gathered in Python beforehand: the same hidden states, bit for bit."""
    name, ours, _ = models
    if ours.kernels is None or not ours.fused_layers or type(ours).hidden_states is not LlamaModel.hidden_states:
        pytest.skip("only the base model's layers' call looks its RoPE rows up by position")
    tokens = random_tokens(ours.arch.vocab_size, (9, 4), seed=41)
    states = []
    for by_position in (True, False):
        runner = PagedRunner(ours, seed=5)
        tables = [runner.allocate(16), runner.allocate(16)]
        runner.step([(tokens[0], 0, tables[0]), (tokens[1], 0, tables[1])])   # fills both caches
        rows = [RowSpec(0, 1, 10, tables[0]), RowSpec(1, 3, 7, tables[1])]    # positions 9, then 4 to 6
        meta = build_metadata(rows, block_size=BLOCK_SIZE, sliding_window=ours.arch.sliding_window,
                              device=torch.device("cpu"), kernel_tile_size=runner.kernel_tile_size)
        positions = torch.tensor([9, 4, 5, 6])
        with torch.no_grad():
            x = ours.embed_tokens(torch.tensor([tokens[1][0], *tokens[0][:3]]))
            if by_position:
                cos, sin = ours.rotary.tables(meta.kernel.max_context)
                before = x.clone()
                with pytest.raises(ValueError, match="refused"):   # position 9 past tables of 9 rows
                    ours._fused_layers(x, cos[:9], sin[:9], meta, runner.cache.layers, positions=positions)
                assert torch.equal(x, before)
                ours._fused_layers(x, cos, sin, meta, runner.cache.layers, positions=positions)
            else:
                cos, sin = ours.rotary.cos_sin(positions)
                ours._fused_layers(x, cos, sin, meta, runner.cache.layers)
        states.append(x)
    assert torch.equal(states[0], states[1]), name
