"""Pydantic models of the agent-facing fields: structured outputs, tools and tool calls.

Request models are strict, as in :mod:`prefixserve.server.openai.protocol` (which uses them). The
shapes are OpenAI's (``response_format``, ``tools``, ``tool_choice``, ``tool_calls``) plus vLLM's
``structured_outputs`` object and its older ``guided_*`` fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Function names: what the OpenAI API allows.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: a named JSON schema."""

    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema",
        description="The JSON schema the output must validate against.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the "
                                "schema here.")


class ResponseFormat(_Strict):
    """``response_format``: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                               description="A JSON schema (or its text).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = Field(None, description="The output matches this regex.")
    choice: list[str] | None = Field(None, min_length=1, description="The output is one of "
                                     "these strings.")
    grammar: str | None = Field(None, description="A Lark grammar (llguidance's dialect).")


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the "
                                              "arguments object (absent: no arguments).")
    strict: bool | None = None


class ToolDefinition(_Strict):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(_Strict):
    """A call on an assistant message of the conversation."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


# ---------------------------------------------------------------------- responses
class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A part of a streamed tool call: the first part of call ``index`` has its ``id``,
    ``type`` and ``function.name``; ``function.arguments`` concatenate to the JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
