"""bounded_schema: unbounded integers get JSON's safe range wherever they sit (properties, items, anyOf,
$defs, a type list), bounds and enums the schema gives stay, and the client's schema is not changed."""

from __future__ import annotations

import json

from conveyor.engine.schema_bounds import MAX_SAFE_INTEGER, bounded_schema, bounded_schema_text

SAFE = {"minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}


def test_integers_everywhere_are_bounded() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"},
        "b": {"type": "array", "items": {"type": ["integer", "null"]}},
        "c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "string"}]}},
        "$defs": {"n": {"type": "integer", "minimum": 0}}}
    original = json.loads(json.dumps(schema))
    bounded = bounded_schema(schema)
    assert schema == original
    assert bounded["properties"]["a"] == {"type": "integer", **SAFE}
    assert bounded["properties"]["b"]["items"] == {"type": ["integer", "null"], **SAFE}
    assert bounded["$defs"]["n"] == {"type": "integer", "minimum": 0, "maximum": MAX_SAFE_INTEGER}
    assert bounded["properties"]["c"]["anyOf"][1] == {"type": "string"}


def test_given_bounds_and_enums_stay() -> None:
    for node in ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                 {"type": "integer", "enum": [1, 2]}, {"type": "integer", "const": 7}):
        assert bounded_schema({"type": "object", "properties": {"x": node}})["properties"]["x"] == node


def test_schema_text_that_is_not_an_object_is_left_to_the_compiler() -> None:
    assert bounded_schema_text("not json") == "not json"
    assert bounded_schema_text("[1]") == "[1]"
    assert json.loads(bounded_schema_text('{"type": "integer"}')) == {"type": "integer", **SAFE}
