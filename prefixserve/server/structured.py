"""The request fields that constrain the output, turned into one ``StructuredOutputsParams``.

A request may give at most one of ``response_format`` (``json_object`` / ``json_schema``),
``structured_outputs`` and the ``guided_*`` fields (a forced tool call brings its own grammar,
see :mod:`prefixserve.server.tool_calls`). A JSON schema is checked here against the JSON
Schema meta-schema (with ``jsonschema``), so an invalid schema is a 400 that says
which keyword is wrong; a schema the grammar engine cannot compile is a 400 from the engine,
named after the same field.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.server.errors import ApiError
from prefixserve.server.protocol import GenerationRequest

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def check_json_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON schema (Draft 2020-12 rules,
    or those of the draft its ``$schema`` names)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: a JSON schema must be an object", param=param,
                       code="invalid_json_schema")
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "(root)"
        raise ApiError(400, f"{param} is not a valid JSON schema: at {where}: {error.message}",
                       param=param, code="invalid_json_schema")


def _from_response_format(body: GenerationRequest) -> StructuredOutputsParams | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert fmt.json_schema is not None
    check_json_schema(fmt.json_schema.schema_, "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _from_structured_outputs(body: GenerationRequest) -> StructuredOutputsParams | None:
    field = body.structured_outputs
    if field is None:
        return None
    values = {"json": field.json_, "json_object": bool(field.json_object),
              "regex": field.regex, "choice": field.choice, "grammar": field.grammar}
    given = [k for k, v in values.items() if v not in (None, False)]
    if len(given) != 1:
        raise ApiError(400, "structured_outputs needs exactly one of json, json_object, regex, "
                       f"choice, grammar (got {', '.join(given) or 'none'})",
                       param="structured_outputs", code="invalid_value")
    return _spec(given[0], values[given[0]], "structured_outputs")


def _spec(kind: str, value: Any, param: str) -> StructuredOutputsParams:
    if kind == "json":
        if isinstance(value, dict | bool):
            check_json_schema(value, param)
        return StructuredOutputsParams(json=value)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(value))
    return StructuredOutputsParams(**{kind: value})


def structured_outputs(body: GenerationRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint (None without one) and the field it came from (which a 400
    on it names); a 400 when several fields give one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    spec = _from_response_format(body)
    if spec is not None:
        found.append((spec, "response_format"))
    spec = _from_structured_outputs(body)
    if spec is not None:
        found.append((spec, "structured_outputs"))
    for name in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append((_spec(name.removeprefix("guided_"), value, name), name))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise ApiError(400, f"give at most one output constraint; got {names}",
                       param=found[1][1], code="invalid_value")
    if not found:
        return None, "structured_outputs"
    return found[0]
