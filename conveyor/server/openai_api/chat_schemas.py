"""Pydantic schemas of a chat conversation and its tools: messages, tool definitions, tool_choice.

chat_tools.py renders them for the chat template and turns tool_choice into a grammar; request_schemas.py's
ChatCompletionRequest holds them. Also the strict text type and field config every request schema uses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from conveyor.errors import InvalidRequest

REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


def _valid_unicode(text: str) -> str:
    """JSON can carry a lone surrogate (\\ud800) that no tokenizer can encode; refuse it here."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def refuse_extra_fields(extra: dict[str, Any] | None, unsupported: dict[str, tuple[str, tuple[object, ...]]]) -> None:
    """400 for a body field conveyor would otherwise ignore: a known one it does not support (unless its value
    changes nothing: null or one of `unsupported`'s values), or an unknown one."""
    for name, value in (extra or {}).items():
        if name in unsupported:
            reason, accepted = unsupported[name]
            if value is not None and value not in accepted:
                raise InvalidRequest(f"{name}: {reason}", param=name)
        elif value is not None:
            raise InvalidRequest(f"{name}: unknown field; conveyor does not support it (docs/api.md lists "
                                 f"every request field)", param=name)


class TextContentPart(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: Text


class FunctionCallIn(BaseModel):
    model_config = REQUEST_CONFIG

    name: Text
    arguments: Text = Field(description="the arguments as a JSON text, as OpenAI sends them")


class ToolCallIn(BaseModel):
    """An earlier assistant turn's tool call, sent back with the conversation."""

    model_config = REQUEST_CONFIG

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image or audio part gets one plain sentence, not the union's every complaint."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported by this model, "
                                     f"which reads text only")
        return content

    @property
    def text(self) -> str | None:
        """Text parts are joined with newlines, as vLLM does, since templates expect a string."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema; omitted means no arguments")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = REQUEST_CONFIG

    name: Text


class NamedToolChoice(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: NamedFunction
