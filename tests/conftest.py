"""Shared fixtures: tiny random-weight Hugging Face checkpoints (with a tokenizer) built in tmp dirs.

Each checkpoint folder is a complete model: config.json, model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json (ChatML chat template, bos <|im_start|>, eos <|im_end|>).
Weights are seeded and drawn wider than transformers' default init (norm weights and q/k/v biases
included), so a wrongly mapped or ignored tensor changes the logits visibly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--real-gguf", action="append", default=[], metavar="FILE",
                     help="a real GGUF file (e.g. a Q4_K_M download) for the tests marked real_model; repeatable")
    parser.addoption("--sanitize", action="store_true",
                     help="run the C kernels built with ASan and UBSan (python needs LD_PRELOAD of libasan)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--sanitize"):
        from conveyor import kernels

        kernels.use_sanitizers()


@pytest.fixture
def real_gguf(request: pytest.FixtureRequest) -> Path:
    files = request.config.getoption("--real-gguf")
    if not files:
        pytest.skip("no --real-gguf=FILE given (the real-file tier runs only on a file you have)")
    return Path(files[0])


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKENIZER_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. the world is big and the sky is blue.",
    "What is the capital of France? The capital of France is Paris.",
    "def main():\n    return 42\n",
    "user assistant system: you are a helpful assistant.",
] * 10
TOKENIZER_VOCAB_SIZE = 300   # 256 byte tokens + 3 specials + merges; below every model's vocab_size
MODEL_VOCAB_SIZE = 320       # padded past the tokenizer, as real checkpoints often are

_COMMON = dict(
    vocab_size=MODEL_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

# name -> (transformers class name, config class name, config kwargs)
TINY_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )),
    "llama_untied": ("LlamaForCausalLM", "LlamaConfig", dict(
        _COMMON, num_hidden_layers=3, tie_word_embeddings=False,
        # original_max_position_embeddings is small so all three llama3 bands (kept, smoothed,
        # scaled) occur among the 8 frequencies of head_dim 16.
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )),
    # 6 heads over 3 KV heads: two tensor-parallel ranks cannot split the KV heads evenly.
    "llama_kv3": ("LlamaForCausalLM", "LlamaConfig", dict(
        _COMMON, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Qwen3: per-head q/k RMSNorm, and a head_dim (32) that is not hidden / heads (16).
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        _COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )),
    # Phi-3 (Phi-4-mini's shape): q/k/v and gate/up fused in the checkpoint, RoPE on 3/4 of each head.
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    )),
    # Gemma 3: sliding (window 8) and global layers with their own RoPE bases, linear scaling on the
    # global ones only, norms after attention and MLP, GELU, q/k norms, embeddings scaled by sqrt(hidden).
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
    )),
    # q.k scaled by a query_pre_attn_scalar that is not head_dim (Gemma 3 27B), another local base.
    "gemma3_scaled": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=40, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500000.0}},
    )),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=False, sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    # Room for answers long enough to still be running when a test acts on them (seconds, not 0.1 s).
    "llama_long": ("LlamaForCausalLM", "LlamaConfig", dict(
        _COMMON, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )),
}
TINY_MODEL_NAMES = tuple(TINY_SPECS)


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded noise: weights ~ N(0, 0.1^2), norms ~ 1 + N(0, 0.2^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.1 * noise)


def _build_tokenizer_files(folder: Path) -> None:
    """Train a tiny byte-level BPE and save it as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    assert [backend.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    assert backend.get_vocab_size() <= MODEL_VOCAB_SIZE
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, additional_special_tokens=[],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    # Keep the template inside tokenizer_config.json (the older, most widely read layout).
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("chat_template", CHATML_TEMPLATE)
    config_file.write_text(json.dumps(config, indent=2))


def build_tiny_checkpoint(name: str, folder: Path, tokenizer_folder: Path | None = None, seed: int = 0) -> Path:
    """Write the tiny checkpoint `name` (a key of TINY_SPECS) into `folder` and return it."""
    import transformers

    model_cls_name, config_cls_name, kwargs = TINY_SPECS[name]
    config = getattr(transformers, config_cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32)
    _randomize_(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_folder is None:
        _build_tokenizer_files(folder)
    else:
        for file in tokenizer_folder.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (folder / file.name).write_bytes(file.read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`make(name) -> Path` for a name in TINY_MODEL_NAMES; each folder is built once per session."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, Path] = {}
    tokenizer_folder: list[Path] = []

    def make(name: str) -> Path:
        if name not in built:
            if name not in TINY_SPECS:
                raise KeyError(f"unknown tiny checkpoint {name!r}; known: {', '.join(TINY_MODEL_NAMES)}")
            source = tokenizer_folder[0] if tokenizer_folder else None
            built[name] = build_tiny_checkpoint(name, root / name, source, seed=len(built) + 1)
            if not tokenizer_folder:
                tokenizer_folder.append(built[name])
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint_factory: Callable[[str], Path]) -> Path:
    """LlamaForCausalLM, 2 layers, tied embeddings, rope_theta 50000."""
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_untied(tiny_checkpoint_factory: Callable[[str], Path]) -> Path:
    """LlamaForCausalLM, 3 layers, separate lm_head, llama3 RoPE scaling."""
    return tiny_checkpoint_factory("llama_untied")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint_factory: Callable[[str], Path]) -> Path:
    """Qwen2ForCausalLM, 2 layers, tied embeddings, nonzero q/k/v biases."""
    return tiny_checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoint_factory: Callable[[str], Path]) -> Path:
    """Qwen3ForCausalLM, 2 layers, tied embeddings, q/k norms, head_dim 32 over hidden 64."""
    return tiny_checkpoint_factory("qwen3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_checkpoint_factory: Callable[[str], Path]) -> Path:
    """MistralForCausalLM, 2 layers, untied, sliding_window 8 on every layer."""
    return tiny_checkpoint_factory("mistral")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_llama: Path) -> Path:
    """The default tiny model for engine, parity and server tests."""
    return tiny_llama
