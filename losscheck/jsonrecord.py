"""Frozen dataclasses as JSON, and their JSON schema: the one codec of losscheck's records (a
cell's record, a process's manifest).

A record is a frozen dataclass whose fields are typed with str, int, float, bool, None, `Literal`,
unions of these, `tuple[X, ...]`, `dict[str, X]`, `object` (free-form JSON, e.g. a model's own
identity) and other records. `encode` writes it (records as objects, tuples as arrays); a field
whose metadata is `FLAT` has its record's fields merged into the enclosing object, and the None
fields of a record whose class sets `OMIT_NONE` are left out. A field's
metadata may give its JSON name (`json_field(name=...)`, for a key that is no identifier) and
schema keywords (`json_field(doc=..., minimum=0, ...)`); a class's `SCHEMA` adds keywords to its
definition. `decode` reads JSON back as a record type, ignoring keys the record does not
know and raising `LosscheckError` with the path and the expected type of any value it cannot
read; `json_schema` writes the draft 2020-12 schema of a record type, one definition per record
class. Imports nothing heavy: the xdist controller reads records without torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Literal, TypeVar, Union

from losscheck.errors import LosscheckError

Scalar = str | int | float | bool | None
FLAT = {"flat": True}  # a field whose record's keys sit in the enclosing object


def json_field(name: str | None = None, doc: str | None = None, **schema: object) -> dict[str, object]:
    """A field's metadata: its JSON name (default: the field's), its description and other schema
    keywords for the published schema."""
    keywords = {**({"description": doc} if doc else {}), **schema}
    return {**({"name": name} if name else {}), **({"schema": keywords} if keywords else {})}


def _key(f: dataclasses.Field[object]) -> str:
    return str(f.metadata.get("name", f.name))


T = TypeVar("T")
R = TypeVar("R", bound="JsonRecord")


class JsonRecord:
    """A record (a frozen dataclass that derives from this) that writes and reads its own JSON."""

    def to_json(self) -> dict[str, object]:
        encoded = encode(self)
        assert isinstance(encoded, dict)
        return encoded

    @classmethod
    def from_json(cls: type[R], data: object, where: str | None = None) -> R:
        """The record of `data`; `LosscheckError` naming the path (from `where`, by default the
        record's name) of a missing or mistyped value."""
        return decode(cls, data, where or _snake(cls.__name__))


def encode(value: object) -> object:
    """`value` as JSON: records as objects (the fields of a flat one merged into its parent's;
    None fields left out of a record whose class sets `OMIT_NONE`), tuples as arrays."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        omit = getattr(value, "OMIT_NONE", False)
        out: dict[str, object] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.metadata.get("flat"):
                inner = encode(v)
                assert isinstance(inner, dict)
                out.update(inner)
            elif v is not None or not omit:
                out[_key(f)] = encode(v)
        return out
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(tp: type[T], data: object, where: str) -> T:
    """`data` read as `tp` (a record class or a field type of one)."""
    return typing.cast(T, _decode(tp, data, where))


def _decode(tp: object, data: object, where: str) -> object:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is object:  # free-form JSON
        return data
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _decode(option, data, where)
            except LosscheckError as exc:
                errors.append(str(exc))
        raise LosscheckError(errors[0] if len(options) == 1 else f"{where}: {data!r} is none of {_name(tp)}")
    if origin is Literal:
        if data not in args:
            raise LosscheckError(f"{where}: {data!r} is not one of {', '.join(map(repr, args))}")
        return data
    if origin is tuple:
        return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(_of(list, data, where)))
    if origin is dict:
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in _of(dict, data, where).items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record(tp, _of(dict, data, where), where)
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise LosscheckError(f"{where}: expected a number, found {data!r}")
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, typing.cast(type, tp)) or (tp is int and isinstance(data, bool)):
            raise LosscheckError(f"{where}: expected {_name(tp)}, found {data!r}")
        return data
    raise TypeError(f"{where}: no JSON form for {tp!r}")


def _record(cls: type, data: dict[str, object], where: str) -> object:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        key = _key(f)
        if f.metadata.get("flat"):
            values[f.name] = _record(hints[f.name], data, where)
        elif key in data and data[key] is not None:
            values[f.name] = _decode(hints[f.name], data[key], f"{where}.{key}")
        elif not _has_default(f) and not _optional(hints[f.name]):
            raise LosscheckError(f"{where}: {key!r} is missing")
        elif not _has_default(f):
            values[f.name] = None
    return cls(**values)


def _of(kind: type[T], data: object, where: str) -> T:
    if not isinstance(data, kind):
        raise LosscheckError(f"{where}: expected {'an array' if kind is list else 'an object'}, found {data!r}")
    return data


def _has_default(f: dataclasses.Field[object]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _optional(tp: object) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _name(tp: object) -> str:
    return getattr(tp, "__name__", str(tp))


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def json_schema(cls: type) -> dict[str, object]:
    """The JSON schema (draft 2020-12) of `cls`'s JSON form: `{"$ref": ..., "$defs": ...}` with
    a definition per record class, named as the class in snake case."""
    defs: dict[str, object] = {}
    return {"$ref": _schema(cls, defs)["$ref"], "$defs": defs}


def _schema(tp: object, defs: dict[str, object]) -> dict[str, object]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is object:
        return {}
    if origin in (Union, types.UnionType):
        options = [_schema(a, defs) for a in args]
        scalars = [o["type"] for o in options if set(o) == {"type"} and isinstance(o["type"], str)]
        return {"type": scalars} if len(scalars) == len(options) else {"anyOf": options}
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin is tuple:
        return {"type": "array", "items": _schema(args[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(args[1], defs)}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = _snake(tp.__name__)
        if name not in defs:
            defs[name] = {}  # reserve the name before the fields refer back to it
            properties, required = _fields(tp, defs)
            doc = {"description": " ".join(tp.__doc__.split())} if tp.__doc__ else {}
            extra = getattr(tp, "SCHEMA", {})
            defs[name] = {"type": "object", **doc, "required": required, "properties": properties, **extra}
        return {"$ref": f"#/$defs/{name}"}
    if isinstance(tp, type) and tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    raise TypeError(f"no JSON schema for {tp!r}")


def _fields(cls: type, defs: dict[str, object]) -> tuple[dict[str, object], list[str]]:
    """The properties and required keys of `cls`'s object, flat fields' merged in."""
    hints = typing.get_type_hints(cls)
    properties: dict[str, object] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("flat"):
            inner, needed = _fields(hints[f.name], defs)
            properties.update(inner)
            required += needed
            continue
        properties[_key(f)] = {**_schema(hints[f.name], defs), **f.metadata.get("schema", {})}
        if not _has_default(f):  # written always (None as null), though a reader takes it as absent
            required.append(_key(f))
    return properties, required


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))
