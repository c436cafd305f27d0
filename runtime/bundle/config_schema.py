"""The JSON Schema of dflash_config.json, generated from the config dataclasses.

Shipped in every bundle (dflash_config.schema.json) for editors and CI linters: types,
defaults, allowed policy names, no unknown fields. The runtime's own loader
(config.load_config) checks the same and more (ranges, cross-field rules), naming the field.
"""

from __future__ import annotations

import dataclasses
import typing

from dspark.runtime.bundle.config import METHOD_CHOICES, WINDOW_POLICIES, DFlashConfig

_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _schema(tp: object, default: object = dataclasses.MISSING) -> dict:
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        props = {}
        for f in dataclasses.fields(tp):
            d = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            props[f.name] = _schema(hints[f.name], d)
        out = {"type": "object", "properties": props, "additionalProperties": False}
    elif typing.get_origin(tp) is tuple:
        out = {"type": "array", "items": _schema(typing.get_args(tp)[0])}
    else:
        out = {"type": _TYPES[tp]} if tp is not float else {"type": "number"}
    if default is not dataclasses.MISSING and default is not None:
        out["default"] = _plain(default)
    return out


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def config_schema() -> dict:
    schema = _schema(DFlashConfig)
    schema["properties"]["window"]["properties"]["policy"]["enum"] = list(WINDOW_POLICIES)
    schema["properties"]["drafting"]["properties"]["method"]["enum"] = list(METHOD_CHOICES)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "DFlash scheduler configuration (dflash_config.json)", **schema}
