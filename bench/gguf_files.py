"""Small GGUF files for benchmarks and test fixtures: a real file's tokenizer beside weights of our own."""

from __future__ import annotations

import gguf


def copy_tokenizer(src: gguf.GGUFReader, out: gguf.GGUFWriter) -> int:
    """The tokenizer's and chat template's keys as the source file has them; returns its vocabulary size."""
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            out.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            out.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            out.add_bool(key, value)
        else:
            out.add_uint32(key, int(value))
    return len(src.fields["tokenizer.ggml.tokens"].contents())
