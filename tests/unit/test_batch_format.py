"""Batch input files are hostile: lines end at \\n only, a repeated custom_id and a line nested too
deeply to parse are that line's error, and bytes that are not UTF-8 spoil only their own line."""

from __future__ import annotations

import json

from conveyor.server.batch.format import parse_lines, split_lines


def line(custom_id: str, prompt: str) -> str:
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": prompt}},
                      ensure_ascii=False)


def test_lines_end_at_newline_only() -> None:
    # Raw U+2028, U+2029 and U+0085 are legal inside a JSON string; str.splitlines cuts there.
    texts = [line(f"q{i}", f"a{sep}b") for i, sep in enumerate(["\u2028", "\u2029", "\u0085", "\x1c", "\x0c"])]
    content = ("\n".join(texts) + "\r\n\n  \n").encode("utf-8")
    lines = parse_lines(split_lines(content))
    assert [(x.number, x.custom_id, x.error) for x in lines] == [(i + 1, f"q{i}", None) for i in range(5)]
    assert lines[0].body == {"prompt": "a\u2028b"}


def test_a_repeated_custom_id_is_an_error_naming_the_first_line() -> None:
    content = "\n".join([line("a", "x"), line("b", "y"), line("a", "z")]).encode()
    lines = parse_lines(split_lines(content))
    assert [x.duplicate_of for x in lines] == [None, None, 1]
    assert lines[2].error is not None and "line 1" in lines[2].error


def test_deep_nesting_and_bad_bytes_are_their_own_lines_errors() -> None:
    deep = '{"custom_id": "deep", "url": "/v1/completions", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    content = b"\n".join([deep.encode(), b"\xff\xfe not utf-8", line("ok", "x").encode()])
    lines = parse_lines(split_lines(content))
    assert "nested too deeply" in (lines[0].error or "")
    assert "UTF-8" in (lines[1].error or "")
    assert lines[2].error is None and lines[2].custom_id == "ok"
