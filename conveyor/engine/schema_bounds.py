"""Bounds for a JSON schema's open-ended integers, before it becomes a grammar.

An integer without a minimum or maximum lets a model that keeps writing digits run until max_tokens
and leave invalid JSON. It is bounded here to JSON's safe range (what JavaScript and most parsers hold
exactly: at most 16 digits), which costs milliseconds of compiling. Bounds the schema gives are kept.
Strings keep the schema's own maxLength only: with xgrammar 0.2.8 a default maxLength costs 1-2 s of
compiling per string property of every new schema (measured on the bundled model's vocabulary); the
sampler bounds them instead (json_strings.py). The client's schema is not changed: a bounded copy is compiled.
"""

from __future__ import annotations

import copy
import json
from typing import Any

MAX_SAFE_INTEGER = 2**53 - 1


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bound(node: dict[str, Any]) -> None:
    if "enum" in node or "const" in node:
        return
    if "integer" in _types(node):
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = MAX_SAFE_INTEGER


def bounded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` with every unbounded integer bounded (walked without recursion)."""
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            _bound(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def bounded_schema_text(schema: str | dict[str, Any]) -> str:
    """`bounded_schema` of a schema given as a dict or its JSON text (text that is not an object is kept,
    for the compiler to refuse with its own reason)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except (ValueError, RecursionError):
            return schema
        if not isinstance(parsed, dict):
            return schema
        schema = parsed
    try:
        return json.dumps(bounded_schema(schema))
    except RecursionError:   # nested past Python's stack: the compiler refuses it with its own reason
        return schema if isinstance(schema, str) else json.dumps(schema)
