"""Text <-> token ids for the engine.

Owns the `Tokenizer` (a `tokenizers.Tokenizer` built from GGUF metadata or a Hugging Face tokenizer
folder, plus its special tokens and BOS policy), rendering the checkpoint's own chat template the way
transformers does, and the `IncrementalDetokenizer` that turns a stream of sampled ids into text deltas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from conveyor.errors import InvalidRequest

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
# Every id that ends generation: llama.cpp's end-of-generation set, from metadata only.
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

# Split patterns in `tokenizers` (Oniguruma) syntax; llama.cpp keeps these originals as comments
# next to its hand-expanded versions in llama-vocab.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (pre-tokenizer kind, ignore_merges, add_bos default), after llama.cpp's table.
_GGUF_PRE: dict[str, tuple[str, bool, bool]] = {
    **{name: ("gpt2", False, False) for name in (
        "default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v2-es",
        "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat", "exaone4", "trillion",
        "granite-docling", "a.x-4.0", "mellum",
    )},
    **{name: ("digits", False, False) for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
    )},
    **{name: ("llama3", True, True) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    )},
    **{name: ("llama3", False, False) for name in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4")},
    **{name: ("qwen2", False, False) for name in (
        "qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2",
    )},
}


def _make_pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if kind == "digits":
        # Same as the GPT-2 split except every digit stands alone (llama.cpp's "\p{N}" pass first).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _special_token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as serialized AddedToken dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognized special token entry in tokenizer_config.json: {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _pick_chat_template(value: Any) -> str | None:
    """A chat template is a string or, in older configs, a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise ValueError(f"unrecognized chat_template entry: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Chat templates, rendered with the same environment transformers builds in chat_template_utils.


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by a template's own `raise_exception(...)`: its message is meant for the caller."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's built-in tojson escapes HTML characters, which changes what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` marker and renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, BOS policy and chat template of one checkpoint.

    Special tokens in text (like `<|im_start|>`) are matched whole, as Hugging Face does. BOS is
    prepended by `encode` only, and only when `add_bos` is set; the backend adds nothing itself.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend: BackendTokenizer = backend
        if vocab_size is None:
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size: int = vocab_size
        self.bos_token: str | None = bos_token
        self.eos_token: str | None = eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = set(eos_token_ids)
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is None:
                logger.warning("eos token %r is not in the vocabulary", eos_token)
            else:
                eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        if add_bos and self.bos_token_id is None:
            raise ValueError(f"add_bos is set but the bos token {bos_token!r} is not in the vocabulary")
        self.add_bos: bool = add_bos
        self.chat_template: str | None = chat_template
        self._compiled_template: jinja2.Template | None = None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos={self.add_bos})"
        )

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            assert self.bos_token_id is not None  # checked in __init__
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat template -------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the checkpoint's template, as transformers' apply_chat_template(tokenize=False).

        Raises `InvalidRequest` (a `ValueError`) when there is no template or the template rejects
        the messages, and `ValueError` when the template itself does not parse.
        """
        if self.chat_template is None:
            raise InvalidRequest("this model has no chat template; send a plain prompt instead of messages")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        # Like transformers: drop None fields, since OpenAI clients send content=None and templates choke on it.
        chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
        try:
            return self._compiled_template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except _TemplateRaised as exc:
            raise InvalidRequest(exc.message or "chat template rejected the messages") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template failed on these messages: {exc}") from exc

    # -- loaders -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path | GGUFReader) -> Tokenizer:
        """Build a byte-level BPE (`tokenizer.ggml.model == "gpt2"`) from a GGUF file's metadata.

        Accepts an open `GGUFReader` too: parsing the metadata takes seconds, so a loader can share one.
        """
        from gguf import GGUFReader  # gguf is only needed for GGUF checkpoints

        if isinstance(path, GGUFReader):
            reader, source = path, str(getattr(path.data, "filename", "GGUF"))
        else:
            reader, source = GGUFReader(path), str(path)

        def field(name: str, default: Any = None) -> Any:
            f = reader.fields.get(name)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{source}: unsupported GGUF tokenizer model {model!r}; only 'gpt2' (byte-level BPE) is supported"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges_raw: list[str] | None = field("tokenizer.ggml.merges")
        if not tokens or not merges_raw:
            raise ValueError(f"{source}: GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
        token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if not token:
                token = f"[EMPTY_{i}]"  # llama.cpp's name for empty entries, so ids stay dense
            if token in vocab:
                logger.warning(
                    "%s: token %r repeats at ids %d and %d; keeping the first", source, token, vocab[token], i
                )
                continue
            vocab[token] = i
        merges: list[tuple[str, str]] = []
        for merge in merges_raw:
            cut = merge.find(" ", 1)  # a merge's left half may itself start with a space
            merges.append((merge[:cut], merge[cut + 1 :]))

        pre = field("tokenizer.ggml.pre", "default")
        if pre in _GGUF_PRE:
            kind, ignore_merges, add_bos_default = _GGUF_PRE[pre]
        else:
            logger.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 byte-level split", source, pre)
            kind, ignore_merges, add_bos_default = "gpt2", False, False

        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = _make_pre_tokenizer(kind)
        backend.decoder = decoders.ByteLevel()
        # Control tokens are special (dropped by skip_special_tokens); user-defined ones are matched whole
        # but kept in decoded text, as in llama.cpp and transformers.
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(token_types)
            if t == _TOKEN_TYPE_CONTROL and tokens[i]
        ]
        added = [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(token_types)
            if t == _TOKEN_TYPE_USER_DEFINED and tokens[i]
        ]
        backend.add_special_tokens(special)
        backend.add_tokens(added)

        def token_at(key: str) -> str | None:
            token_id = field(key)
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        eos_ids = [
            int(token_id)
            for key in _GGUF_EOS_KEYS
            if (token_id := field(key)) is not None and 0 <= token_id < len(tokens)
        ]
        add_bos = field("tokenizer.ggml.add_bos_token")
        return cls(
            backend,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            eos_token_ids=eos_ids,
            add_bos=add_bos_default if add_bos is None else bool(add_bos),
            chat_template=field("tokenizer.chat_template"),
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json`, the chat template files and `generation_config.json`."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}; a Hugging Face tokenizer folder needs one")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}

        bos_token = _special_token_content(config.get("bos_token"))
        eos_token = _special_token_content(config.get("eos_token"))

        # Precedence as in transformers: chat_template.jinja, then chat_template.json, then the config.
        chat_template = _pick_chat_template(config.get("chat_template"))
        if (folder / "chat_template.jinja").is_file():
            chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "chat_template.json").is_file():
            chat_template = _pick_chat_template(_read_json(folder / "chat_template.json").get("chat_template"))

        eos_ids: list[int] = []
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            eos = _read_json(generation_file).get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else [int(i) for i in eos or []]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: follow what tokenizer.json's own post-processor would add.
            bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=chat_template,
        )


class IncrementalDetokenizer:
    """Turns sampled token ids into text deltas, one token at a time.

    Uses vLLM/TGI's two offsets: `prefix_offset..read_offset` are tokens already shown, decoded again
    as context, and text is emitted only for what decoding `prefix_offset..` adds beyond that. A delta
    that ends in U+FFFD is an incomplete UTF-8 sequence, so it is held back until later tokens finish it.
    Invariant: `text` is a prefix of decode(all output ids), equal to it whenever nothing is held back.
    """

    # Prompt tokens decoded with the first outputs so decoders that look at context (leading spaces) agree.
    _PROMPT_CONTEXT_TOKENS = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids or [])[-self._PROMPT_CONTEXT_TOKENS :]
        self._read_offset = len(self._token_ids)
        self._prefix_offset = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the prompt is not included)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one output token and return the newly completed text (possibly empty)."""
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._token_ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        new_text = decode(self._token_ids[self._prefix_offset :], self._skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text += delta
        return delta
