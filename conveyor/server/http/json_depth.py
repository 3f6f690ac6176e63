"""How deeply a JSON text nests, checked before anything parses it.

Python's json module and everything that walks a parsed value recurse once per level, so a
100,000-deep `[[[...]]]` ends in a RecursionError (a 500) or in minutes of work. A body or a
tool call's arguments nesting deeper than MAX_JSON_DEPTH is refused with a 400 instead.
"""

from __future__ import annotations

import itertools
import re

MAX_JSON_DEPTH = 128   # far past any real request (a JSON schema rarely nests 20 levels)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # +1 and -1 as signed bytes


def nests_deeper_than(text: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text opens more than max_depth arrays or objects inside each other.

    One pass: strings are dropped and the brackets left are summed as +1 / -1; a text with
    fewer brackets than max_depth is not scanned at all.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    steps = _STRING.sub(b"", data).translate(_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(memoryview(steps).cast("b")), default=0) > max_depth
