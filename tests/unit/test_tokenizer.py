"""Tokenizer, chat template and incremental detokenizer on a tiny byte-level BPE built in tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from conveyor.text.gguf_vocab import tokenizer_from_gguf
from conveyor.text.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.text.tokenizer_loader import tokenizer_from_hf_folder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. the world is big.",
    "def main():\n    return 42\n",
] * 20
# Multi-byte characters that the tiny vocabulary keeps as separate byte tokens.
MULTIBYTE = "héllo 日本語 👩‍👩‍👧 🇫🇷 naïve ∑ 😀!"


def _train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    return _train_backend()


def _write_folder(
    folder: Path,
    backend: BackendTokenizer,
    *,
    config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    base = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.fixture
def tok(tmp_path: Path, backend: BackendTokenizer) -> Tokenizer:
    return tokenizer_from_hf_folder(_write_folder(tmp_path / "tok", backend))


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(
        tok.backend,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_ids=tok.eos_token_ids,
        add_bos=tok.add_bos,
        chat_template=template,
    )


# -- loading, special tokens, BOS --------------------------------------------------------------


def test_hf_folder_special_tokens_and_generation_config_eos(tmp_path: Path, backend: BackendTokenizer) -> None:
    folder = _write_folder(tmp_path, backend, generation_config={"eos_token_id": [2, 0]})
    tok = tokenizer_from_hf_folder(folder)
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == CHATML


def test_generation_config_single_int_eos(tmp_path: Path, backend: BackendTokenizer) -> None:
    folder = _write_folder(tmp_path, backend, generation_config={"eos_token_id": 0})
    assert tokenizer_from_hf_folder(folder).eos_token_ids == frozenset({0, 2})


def test_special_tokens_given_as_added_token_dicts(tmp_path: Path, backend: BackendTokenizer) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "eos_token": {"content": "<|im_end|>"},
    }
    tok = tokenizer_from_hf_folder(_write_folder(tmp_path, backend, config=config))
    assert tok.bos_token == "<|endoftext|>" and tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({2})


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)


def test_no_bos_unless_configured(tok: Tokenizer) -> None:
    assert tok.add_bos is False
    assert tok.encode("hello world")[0] != tok.bos_token_id
    assert tok.encode("hello world") == tok.encode("hello world", add_special_tokens=False)


def test_add_bos_token_flag(tmp_path: Path, backend: BackendTokenizer) -> None:
    tok = tokenizer_from_hf_folder(_write_folder(tmp_path, backend, config={"add_bos_token": True}))
    plain = tok.encode("hello world", add_special_tokens=False)
    assert tok.add_bos is True
    assert tok.encode("hello world") == [1, *plain]
    assert tok.bos_token_id not in plain


def test_add_bos_detected_from_post_processor(tmp_path: Path) -> None:
    backend = _train_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    tok = tokenizer_from_hf_folder(_write_folder(tmp_path, backend))
    assert tok.add_bos is True
    # BOS comes from our own rule once, not again from the backend's post-processor.
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


def test_special_tokens_in_text_are_parsed(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>"
    assert tok.decode(ids) == "user\nhello"


def test_round_trip_multibyte(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE


# -- chat template -----------------------------------------------------------------------------


def test_token_bytes_are_each_tokens_own_bytes(tok: Tokenizer) -> None:
    text = MULTIBYTE + "<|im_end|>"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    partial = [p for p in pieces if p and p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore")]
    assert partial and all(len(p) < 4 for p in partial)   # parts of characters, not U+FFFD's bytes
    assert tok.token_bytes(tok.backend.token_to_id("<|im_end|>")) == b"<|im_end|>"


def test_token_bytes_of_a_byte_fallback_vocabulary() -> None:
    backend = BackendTokenizer(models.BPE({"<0xC3>": 0, "<0xA9>": 1, "\u2581hi": 2, "caf": 3}, []))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(backend)
    assert [tok.token_bytes(i) for i in range(4)] == [b"\xc3", b"\xa9", b" hi", b"caf"]


def test_chatml_render(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_and_special_token_variables(tok: Tokenizer) -> None:
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "[{{ m['content'] }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{{ eos_token }}"
    )
    out = _with_template(tok, template).apply_chat_template([{"role": "user", "content": "a"}])
    assert out == "<|im_start|>\n[a]\n<|im_end|>"


def test_raise_exception_becomes_value_error_with_its_message(tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    t = _with_template(tok, template)
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_tojson_matches_transformers_filter(tok: Tokenizer) -> None:
    # transformers' tojson: json.dumps(ensure_ascii=False), no HTML escaping, keyword options passed through.
    messages = [{"role": "user", "content": "<b>café</b> & 'quotes'"}]
    t = _with_template(tok, "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}")
    expected = json.dumps(messages, ensure_ascii=False) + "|" + json.dumps(
        messages[0], ensure_ascii=False, indent=2, sort_keys=True
    )
    assert t.apply_chat_template(messages) == expected


def test_template_helpers(tok: Tokenizer) -> None:
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}|{{ strftime_now('%Y') | length }}|"
        "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}|"
        "{{ 'content' in messages[1] }}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "c"},
    ]
    assert _with_template(tok, template).apply_chat_template(messages) == "2|4|a|False"


def test_namespace_rejects_underscore_attributes(tok: Tokenizer) -> None:
    t = _with_template(tok, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(ValueError):
        t.apply_chat_template([{"role": "user", "content": "a"}])


def test_sandbox_blocks_attribute_escape(tok: Tokenizer) -> None:
    t = _with_template(tok, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError):
        t.apply_chat_template([{"role": "user", "content": "a"}])


def test_no_template_is_a_clear_value_error(tok: Tokenizer) -> None:
    t = Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "a"}])


def test_template_syntax_error_is_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="invalid chat template"):
        _with_template(tok, "{% for m in messages %}").apply_chat_template([{"role": "user", "content": "a"}])


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path, backend: BackendTokenizer) -> None:
    folder = _write_folder(tmp_path / "a", backend)
    (folder / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert tokenizer_from_hf_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"

    folder = _write_folder(tmp_path / "b", backend, config={"chat_template": None})
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "S{{ messages | length }}"}))
    assert tokenizer_from_hf_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "S1"


# -- incremental detokenizer -------------------------------------------------------------------


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def test_multibyte_chars_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # The tiny vocabulary really does cut characters in pieces.
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # incomplete sequences were held back, not emitted


def test_detokenizer_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nsay 日本<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode(" hello 👩‍👩‍👧 world")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(detok, out)) == detok.text == tok.decode(out) == " hello 👩‍👩‍👧 world"


def test_detokenizer_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>")
    assert IncrementalDetokenizer(tok).push(ids[0]) == "h"
    skipping = IncrementalDetokenizer(tok)
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(skipping, ids)) == "hi"
    assert "".join(_stream(keeping, ids)) == "hi<|im_end|>"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), prompt=st.text(max_size=10))
def test_incremental_equals_full_decode(backend: BackendTokenizer, text: str, prompt: str) -> None:
    tok = Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = _stream(detok, ids)
    full = tok.decode(ids)
    assert "".join(deltas) == detok.text
    if not full.endswith("\ufffd"):  # a trailing replacement char is indistinguishable from a partial one
        assert detok.text == full


# -- GGUF metadata -----------------------------------------------------------------------------


def _write_gguf(path: Path, backend: BackendTokenizer, **overrides: object) -> Path:
    gguf = pytest.importorskip("gguf")
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    raw_merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    meta: dict[str, object] = {"model": "gpt2", "pre": "gpt-2", "bos": 1, "eos": 2, "eot": None, "add_bos": None}
    meta.update(overrides)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(str(meta["model"]))
    w.add_tokenizer_pre(str(meta["pre"]))
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(int(meta["bos"]))  # type: ignore[arg-type]
    w.add_eos_token_id(int(meta["eos"]))  # type: ignore[arg-type]
    if meta["eot"] is not None:
        w.add_eot_token_id(int(meta["eot"]))  # type: ignore[arg-type]
    if meta["add_bos"] is not None:
        w.add_add_bos_token(bool(meta["add_bos"]))
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_matches_hf_folder(tmp_path: Path, backend: BackendTokenizer, tok: Tokenizer) -> None:
    g = tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", backend, eot=0))
    assert g.vocab_size == tok.vocab_size
    assert g.bos_token_id == 1 and g.bos_token == "<|im_start|>" and g.eos_token == "<|im_end|>"
    assert g.eos_token_ids == frozenset({0, 2})
    assert g.add_bos is False and g.chat_template == CHATML
    for text in [MULTIBYTE, "<|im_start|>user\nhello<|im_end|>", "def main():\n    return 42\n", "", " x  y "]:
        assert g.encode(text) == tok.encode(text)
        assert g.decode(g.encode(text), skip_special_tokens=False) == text


def test_gguf_add_bos_metadata(tmp_path: Path, backend: BackendTokenizer) -> None:
    g = tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", backend, add_bos=True))
    assert g.add_bos is True and g.encode("hello")[0] == 1


def test_gguf_llama3_pre_tokenizer(tmp_path: Path, backend: BackendTokenizer) -> None:
    g = tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", backend, pre="llama-bpe"))
    assert g.add_bos is True  # llama.cpp's default for llama3-style vocabularies without the flag
    pieces = [p for p, _ in g.backend.pre_tokenizer.pre_tokenize_str("I'M 1234567 ok\n\n")]
    assert pieces == ["I", "'M", "Ġ", "123", "456", "7", "Ġok", "ĊĊ"]
    assert g.decode(g.encode("I'M 1234567 ok\n\n")) == "I'M 1234567 ok\n\n"


def test_gguf_qwen2_and_smollm_split_digits(tmp_path: Path, backend: BackendTokenizer) -> None:
    for pre in ("qwen2", "smollm"):
        g = tokenizer_from_gguf(_write_gguf(tmp_path / f"{pre}.gguf", backend, pre=pre))
        pieces = [p for p, _ in g.backend.pre_tokenizer.pre_tokenize_str("a 123")]
        assert pieces[-3:] == ["1", "2", "3"], pre
        assert g.add_bos is False


def test_gguf_unknown_pre_is_refused_by_name(tmp_path: Path, backend: BackendTokenizer) -> None:
    with pytest.raises(ValueError, match=r"pre-tokenizer 'mystery-pre' is not supported; supported: .*\bqwen2\b"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", backend, pre="mystery-pre"))


def test_gguf_unknown_model_is_refused_by_name(tmp_path: Path, backend: BackendTokenizer) -> None:
    with pytest.raises(ValueError, match=r"model 't5' is not supported; supported: 'gpt2' .*'llama'"):
        tokenizer_from_gguf(_write_gguf(tmp_path / "t.gguf", backend, model="t5"))
