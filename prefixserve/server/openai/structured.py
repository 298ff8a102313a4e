"""The request fields that constrain the output, turned into one ``StructuredOutputsParams``.

A request may give at most one of ``response_format`` (``json_object`` / ``json_schema``),
``structured_outputs`` and the ``guided_*`` fields (a forced tool call brings its own grammar,
see :mod:`prefixserve.server.openai.tool_calls`). A JSON schema is checked here against the JSON
Schema meta-schema (with ``jsonschema``), so an invalid schema is a 400 that says
which keyword is wrong; a schema the grammar engine cannot compile is a 400 from the engine,
named after the same field. Before any of that, a schema nested deeper than
``--max-json-schema-depth`` levels of objects and arrays is a 400 naming the limit: the checks
walk a schema recursively, and Python's stack holds about a hundred levels.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.server.errors import ApiError
from prefixserve.server.openai.protocol import GenerationRequest

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def json_depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests objects and arrays (a scalar: 0, ``{}``: 1), counted without
    recursion and only up to ``limit + 1``: a deeper value answers ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_schema(schema: Any, param: str, max_depth: int) -> None:
    """A 400 naming ``param`` unless ``schema`` is a valid JSON schema (Draft 2020-12 rules,
    or those of the draft its ``$schema`` names) nested at most ``max_depth`` levels."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: a JSON schema must be an object", param=param,
                       code="invalid_json_schema")
    if json_depth(schema, max_depth) > max_depth:
        raise ApiError(400, f"{param}: the JSON schema nests objects and arrays more than "
                       f"{max_depth} levels deep (--max-json-schema-depth)", param=param,
                       code="invalid_json_schema")
    validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "(root)"
        raise ApiError(400, f"{param} is not a valid JSON schema: at {where}: {error.message}",
                       param=param, code="invalid_json_schema")


def _from_response_format(body: GenerationRequest,
                          max_depth: int) -> StructuredOutputsParams | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert fmt.json_schema is not None
    check_json_schema(fmt.json_schema.schema_, "response_format", max_depth)
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _from_structured_outputs(body: GenerationRequest,
                             max_depth: int) -> StructuredOutputsParams | None:
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
    return _spec(given[0], values[given[0]], "structured_outputs", max_depth)


def _spec(kind: str, value: Any, param: str, max_depth: int) -> StructuredOutputsParams:
    if kind == "json":
        check_json_schema(_parsed(value, param), param, max_depth)
        return StructuredOutputsParams(json=value)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(value))
    return StructuredOutputsParams(**{kind: value})


def _parsed(value: Any, param: str) -> Any:
    """A schema given as JSON text, parsed (a 400 when it nests too deep to parse)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"{param}: the JSON schema is not valid JSON: {exc}", param=param,
                       code="invalid_json_schema") from None
    except RecursionError:
        raise ApiError(400, f"{param}: the JSON schema nests too deep to parse", param=param,
                       code="invalid_json_schema") from None


def structured_outputs(body: GenerationRequest,
                       max_depth: int) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint (None without one) and the field it came from (which a 400
    on it names); a 400 when several fields give one. JSON schemas may nest ``max_depth``
    levels."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    spec = _from_response_format(body, max_depth)
    if spec is not None:
        found.append((spec, "response_format"))
    spec = _from_structured_outputs(body, max_depth)
    if spec is not None:
        found.append((spec, "structured_outputs"))
    for name in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append((_spec(name.removeprefix("guided_"), value, name, max_depth), name))
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise ApiError(400, f"give at most one output constraint; got {names}",
                       param=found[1][1], code="invalid_value")
    if not found:
        return None, "structured_outputs"
    return found[0]
