"""MCP elicitation forms and the values answered to them: the one check both MCP roles use.

A requested schema (`elicitation/create` form mode) is a flat object of primitive fields, what the MCP spec
allows: `string` (`minLength`, `maxLength`, `format` email / uri / date / date-time, choices by `enum` or
`oneOf` `const`), `number` and `integer` (`minimum`, `maximum`), `boolean`; `required` and `default`.
`fields_of` reads one (FormError for anything else); `content_for` checks an answer against it, strictly: a
value has the field's JSON type (the string "15" is not a number, `true` is not 1), lies in its range and
among its choices, and names no field the form does not have. Every value an MCP client or a person answers
to a form goes through here before it means anything: agent-mcp's own gate forms (`_mcp_elicit.py`), and
the forms of the MCP servers agent-mcp uses, passed on to a person and answered back (`_mcp_asks.py`).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from typing import Any
from urllib.parse import urlsplit

TYPES = ("string", "number", "integer", "boolean")
#: The longest text value taken (whatever the form's own maxLength).
VALUE_CHARS = 2000
FORMATS = ("email", "uri", "date", "date-time")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


class FormError(ValueError):
    """A form this client does not support, or content that does not fit the form; the text says why."""


def _number(spec: dict[str, Any], key: str, name: str) -> float | None:
    bound = spec.get(key)
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, int | float):
        raise FormError(f"field '{name}': {key} is not a number")
    return bound


def fields_of(schema: Any) -> list[dict[str, Any]]:
    """The fields of a requested schema, each {name, type, title, description, required, default, choices,
    minimum, maximum, min_length, max_length, format} (the last ones when the form sets them); FormError for
    anything beyond the flat primitive forms the spec allows."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise FormError("the requested schema is not an object")
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise FormError("the requested schema's properties are not an object")
    required = set(schema.get("required") or ())
    out = []
    for name, spec in props.items():
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise FormError(f"field '{name}' is not a string, number, integer or boolean")
        choices: list[str] | None = None
        if isinstance(spec.get("enum"), list):
            choices = [str(c) for c in spec["enum"]]
        elif isinstance(spec.get("oneOf"), list):
            choices = [str(c.get("const")) for c in spec["oneOf"] if isinstance(c, dict) and "const" in c]
        limits: dict[str, Any] = {}
        if spec["type"] in ("number", "integer"):
            for key in ("minimum", "maximum"):
                if (bound := _number(spec, key, str(name))) is not None:
                    limits[key] = bound
        elif spec["type"] == "string":
            for key, kept in (("minLength", "min_length"), ("maxLength", "max_length")):
                if (bound := _number(spec, key, str(name))) is not None:
                    limits[kept] = int(bound)
            if spec.get("format") in FORMATS:
                limits["format"] = spec["format"]
        out.append({"name": str(name), "type": spec["type"], "title": str(spec.get("title") or name),
                    "description": str(spec.get("description") or ""), "required": name in required,
                    **({"default": spec["default"]} if "default" in spec else {}),
                    **({"choices": choices} if choices else {}), **limits})
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:60] + "…"


def kind_of(field: dict[str, Any]) -> str:
    """What a field takes, in words: `an integer from 1 to 9`, `one of: veg, meat`, `true or false`."""
    if field.get("choices"):
        return "one of: " + ", ".join(field["choices"])
    kind = field["type"]
    if kind == "boolean":
        return "true or false"
    if kind == "string":
        what = f"text ({field['format']})" if field.get("format") else "text"
        low, high = field.get("min_length"), field.get("max_length")
        if low is not None or high is not None:
            what += f" of {low or 0} to {min(high if high is not None else VALUE_CHARS, VALUE_CHARS)} characters"
        return what
    what = "an integer" if kind == "integer" else "a number"
    low, high = field.get("minimum"), field.get("maximum")
    if low is not None and high is not None:
        return f"{what} from {low:g} to {high:g}"
    if low is not None:
        return f"{what} of at least {low:g}"
    if high is not None:
        return f"{what} of at most {high:g}"
    return what


def _format_ok(fmt: str, value: str) -> bool:
    try:
        if fmt == "email":
            return bool(_EMAIL.match(value))
        if fmt == "uri":
            parts = urlsplit(value)
            return bool(parts.scheme and (parts.netloc or parts.path))
        if fmt == "date":
            datetime.date.fromisoformat(value)
            return True
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return True
    except ValueError:
        return False


def value_for(field: dict[str, Any], value: Any) -> Any:
    """`value` checked against one field (FormError saying what the field takes and what came): no coercion."""
    kind, name = field["type"], field["name"]
    wrong = FormError(f"field '{name}' takes {kind_of(field)}, not {_shown(value)}")
    if kind == "boolean":
        if not isinstance(value, bool):
            raise wrong
        return value
    if kind in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise wrong
        if kind == "integer":
            if not float(value).is_integer():
                raise wrong
            value = int(value)
        low, high = field.get("minimum"), field.get("maximum")
        if (low is not None and value < low) or (high is not None and value > high):
            raise wrong
    else:
        if not isinstance(value, str):
            raise wrong
        if len(value) > VALUE_CHARS:
            raise FormError(f"field '{name}' is longer than {VALUE_CHARS} characters")
        low, high = field.get("min_length"), field.get("max_length")
        if (low is not None and len(value) < low) or (high is not None and len(value) > high):
            raise FormError(f"field '{name}' takes {kind_of(field)}, not {len(value)} characters")
        if field.get("format") and not _format_ok(field["format"], value):
            raise wrong
    if field.get("choices") and str(value) not in field["choices"]:
        raise wrong
    return value


def content_for(fields: list[dict[str, Any]], given: Any) -> dict[str, Any]:
    """The content to accept with: the answered values (each checked, `value_for`) over the form's defaults.
    A plain yes (no values) to a single required yes/no question is a yes."""
    if given is not None and not isinstance(given, dict):
        raise FormError(f"the answer is not an object of field values, but {_shown(given)}")
    known = {f["name"]: f for f in fields}
    if given:
        extra = sorted(set(given) - set(known))
        if extra:
            raise FormError(f"the form has no field {', '.join(extra)} (its fields: {', '.join(known) or 'none'})")
    out: dict[str, Any] = {}
    for f in fields:
        if given and f["name"] in given:
            out[f["name"]] = value_for(f, given[f["name"]])
        elif "default" in f:
            out[f["name"]] = f["default"]
    missing = [f["name"] for f in fields if f["required"] and f["name"] not in out]
    if missing and not given and len(fields) == 1 and fields[0]["type"] == "boolean":
        return {fields[0]["name"]: True}
    if missing:
        raise FormError(f"the form needs a value for {', '.join(missing)}: answer with a JSON object "
                        f"(content) such as {json.dumps({m: '…' for m in missing})}")
    return out


def describe(fields: list[dict[str, Any]]) -> str:
    """The fields in one line: `seats (an integer from 1 to 9, required); meal (one of: veg, meat, default "veg")`."""
    parts = []
    for f in fields:
        parts.append(f"{f['name']} ({kind_of(f)}{', required' if f['required'] else ''}"
                     f"{', default ' + json.dumps(f['default']) if 'default' in f else ''})")
    return "; ".join(parts) or "no fields (a yes or no)"
