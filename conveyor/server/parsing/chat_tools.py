"""Tool calling on chat completions: what the model is shown, and what tool_choice forces.

The model calls a tool in the Hermes / Qwen form, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that takes `tools` gets them as it expects; for one that does not, the tools go
into a system block (DEFAULT_TOOLS_PROMPT, appended to the first system message or put before the
conversation), earlier tool calls are written back into their assistant turns in the same form,
and tool results into `<tool_response>` blocks. `required` and a named function are enforced with
an xgrammar structural tag whose arguments follow each function's JSON schema, and the output is
nothing but the calls: the grammar then admits only the end of the turn, so the reply ends at the
call as OpenAI's does. `auto` is parsed from the output (tool_calls.py).
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.engine.schema_bounds import bounded_schema
from conveyor.engine.structured_output import json_schema_refusal
from conveyor.errors import InvalidRequest
from conveyor.sampling_params import StructuredOutputsParams
from conveyor.server.openai_api.chat_schemas import ChatMessage, NamedToolChoice, ToolDefinition
from conveyor.server.http.json_depth import MAX_JSON_DEPTH, nests_deeper_than

DEFAULT_TOOLS_PROMPT = (
    "You may call one or more functions to answer the user. The functions are described in JSON "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>'
)
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def _tool_dicts(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool.function.model_dump(exclude_none=True)} for tool in tools]


def _call_block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _arguments(text: str, param: str) -> Any:
    """Templates expect arguments as an object; a text that is not JSON is passed on as it is."""
    if nests_deeper_than(text):
        raise InvalidRequest(f"{param}: the arguments nest JSON more than {MAX_JSON_DEPTH} levels deep", param=param)
    try:
        return json.loads(text)
    except ValueError:
        return text


def _arguments_param(message_index: int, call_index: int) -> str:
    return f"messages.{message_index}.tool_calls.{call_index}.function.arguments"


def template_input(messages: list[ChatMessage], tools: list[ToolDefinition] | None, tool_choice: str,
                   template_takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. tool_choice 'none' shows no tools, as the model may not call one."""
    shown = _tool_dicts(tools) if tools and tool_choice != "none" else None
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role, "content": message.text}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            if template_takes_tools:
                entry["tool_calls"] = [{"id": call.id, "type": "function",
                                        "function": {"name": call.function.name,
                                                     "arguments": _arguments(call.function.arguments,
                                                                             _arguments_param(index, i))}}
                                       for i, call in enumerate(message.tool_calls)]
            else:
                blocks = [_call_block(call.function.name,
                                  _arguments(call.function.arguments, _arguments_param(index, i)))
                          for i, call in enumerate(message.tool_calls)]
                entry["content"] = "\n".join(([message.text] if message.text else []) + blocks)
        if message.role == "tool" and not template_takes_tools:
            entry["content"] = f"<tool_response>\n{message.text or ''}\n</tool_response>"
        chat.append(entry)
    if shown is None or template_takes_tools:
        return chat, shown
    block = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in shown))
    if chat and chat[0]["role"] in ("system", "developer"):
        chat[0] = {**chat[0], "content": f"{chat[0]['content'] or ''}\n\n{block}".lstrip()}
    else:
        chat.insert(0, {"role": "system", "content": block})
    return chat, None


def check_tool_schemas(tools: list[ToolDefinition] | None) -> None:
    """Refuse a tool whose parameters are not a JSON schema, or one the grammar compiler cannot enforce.

    Checked whatever tool_choice, so a tool that `required` would refuse is not accepted under `auto`.
    """
    for i, tool in enumerate(tools or []):
        schema = tool.function.parameters
        if schema is None:
            continue
        problem = _metaschema_problem(schema)
        if problem is None and (refusal := json_schema_refusal(schema)) is not None:
            problem = f"it cannot be enforced: {refusal}"
        if problem is not None:
            raise InvalidRequest(f"tool {tool.function.name!r}: its parameters are not a usable JSON schema: {problem}",
                                 param=f"tools[{i}].function.parameters")


def _metaschema_problem(schema: dict[str, Any]) -> str | None:
    """What the JSON Schema metaschema (of the draft the schema names, 2020-12 by default) finds wrong."""
    try:
        import jsonschema
    except ImportError:   # the server extra installs it; without it only the grammar compiler checks
        return None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        return f"{exc.message} (at parameters{where})"
    except RecursionError:
        return "it is nested too deeply"
    return None


def tool_choice_constraint(tools: list[ToolDefinition] | None, tool_choice: str | NamedToolChoice | None,
                           parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The grammar that `required` or a named function puts on the output; None for auto and none."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None

    def tag(tool: ToolDefinition) -> dict[str, Any]:
        function = tool.function
        return {"type": "tag",
                "begin": "<tool_call>\n" + json.dumps({"name": function.name})[:-1] + ', "arguments": ',
                "content": {"type": "json_schema", "json_schema": (bounded_schema(function.parameters)
                                                                   if function.parameters else _NO_ARGUMENTS)},
                "end": "}\n</tool_call>"}

    if isinstance(tool_choice, str):   # required: one call or more (one with parallel_tool_calls false)
        # Calls only, one per line: triggered_tags would let free text follow the call.
        fmt: dict[str, Any] = {"type": "tags_with_separator", "separator": "\n",
                               "tags": [tag(tool) for tool in tools], "at_least_one": True,
                               "stop_after_first": not parallel_tool_calls}
    else:
        [forced] = [tool for tool in tools if tool.function.name == tool_choice.function.name]
        fmt = tag(forced)
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))
