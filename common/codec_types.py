"""Field types of control-plane records: what each annotation allows, in both directions.

A field type is a pair of converters. ``to_wire`` checks a Python value against the
annotation and returns what msgpack packs; ``from_wire`` checks an unpacked value and
returns what the record holds. Both raise ``Mismatch`` (a description, with the path to
the offending part) or ``TooDeep``. Allowed annotations:

- ``int``, ``float`` (an int is made float), ``str``, ``bool``, ``bytes``;
- ``dict``: a str-keyed map of plain msgpack values, nested at most ``MAX_PLAIN_DEPTH``;
- ``list[int]``, ``list[float]``, ``list[str]``, ``list[dict]``, ``list[R]`` and
  ``tuple[int, ...]``
  (a list on the wire, a tuple in the record);
- ``R``: a nested record, a frozen slotted dataclass registered with ``@record``; it
  travels as a map of its fields, checked exactly like a message body;
- ``T | None`` for any of these.

This module is transport-free and must never import torch or numpy.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_PLAIN_DEPTH = 32  # deeper plain values are refused, not walked (no RecursionError)


class Mismatch(Exception):
    """A value does not match a field type: ``detail`` says how, ``path`` where
    (``.sampling.top_k``, ``[3]``), built up as the error leaves each level."""

    def __init__(self, detail: str, path: str = "") -> None:
        super().__init__(detail)
        self.detail, self.path = detail, path

    def within(self, segment: str) -> Mismatch:
        return type(self)(self.detail, segment + self.path)

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}" if self.path else self.detail


class TooDeep(Mismatch):
    """A plain value is nested deeper than ``MAX_PLAIN_DEPTH`` ("malformed", not a
    type error: such a frame is not something any record could hold)."""


Convert = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class FieldType:
    name: str  # as docs/protocol.md writes it
    to_wire: Convert
    from_wire: Convert


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    type: FieldType
    required: bool


@dataclass(frozen=True, slots=True)
class RecordSpec:
    type_name: str
    cls: type
    fields: tuple[FieldSpec, ...]
    names: frozenset[str]


NESTED: dict[type, RecordSpec] = {}  # nested record class -> its spec


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _scalar(name: str, ok: Callable[[Any], bool], coerce: Convert | None = None) -> FieldType:
    def check(v: Any) -> Any:
        if not ok(v):
            raise Mismatch(f"expected {name}, got {type(v).__name__}")
        return coerce(v) if coerce is not None else v

    return FieldType(name, check, check)


_LEAVES = (type(None), bool, int, float, str, bytes)


def check_plain(v: Any, path: str = "value") -> None:
    """Accept only what msgpack carries without extensions: nil, bool, int, float, str,
    bytes, and lists (tuples on encode) or str-keyed maps of these, at most
    ``MAX_PLAIN_DEPTH`` deep. Walks with an explicit stack: the input may come off the wire."""
    stack = [(v, path, 0)]
    while stack:
        x, where, depth = stack.pop()
        if isinstance(x, _LEAVES):
            continue
        if depth >= MAX_PLAIN_DEPTH:
            raise TooDeep(f"{where} is nested deeper than {MAX_PLAIN_DEPTH}")
        if isinstance(x, list | tuple):
            stack.extend((y, f"{where}[{i}]", depth + 1) for i, y in enumerate(x))
        elif isinstance(x, dict):
            for key, y in x.items():
                if not isinstance(key, str):
                    raise Mismatch(f"{where}: map key {key!r} is not a str")
                stack.append((y, f"{where}[{key!r}]", depth + 1))
        else:
            raise Mismatch(f"{where}: {type(x).__name__} is not a plain msgpack value")


def check_depth(v: Any, what: str) -> None:
    """TooDeep if ``v`` nests lists or maps deeper than ``MAX_PLAIN_DEPTH``; nothing else
    is checked (for body keys a record ignores, which a newer sender may fill freely)."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, list | tuple | dict):
            if depth >= MAX_PLAIN_DEPTH:
                raise TooDeep(f"{what} is nested deeper than {MAX_PLAIN_DEPTH}")
            items = x.values() if isinstance(x, dict) else x
            stack.extend((y, depth + 1) for y in items if isinstance(y, list | tuple | dict))


def _dict_check(v: Any) -> Any:
    if not isinstance(v, dict):
        raise Mismatch(f"expected dict, got {type(v).__name__}")
    check_plain(v)
    return v


_SCALARS: dict[Any, FieldType] = {
    int: _scalar("int", is_int),
    float: _scalar("float", lambda v: is_int(v) or isinstance(v, float), float),
    str: _scalar("str", lambda v: isinstance(v, str)),
    bool: _scalar("bool", lambda v: isinstance(v, bool)),
    bytes: _scalar("bytes", lambda v: isinstance(v, bytes)),
    dict: FieldType("dict", _dict_check, _dict_check),
}
_LIST_ITEMS = (int, float, str, dict)


def _items(shown: str, kind: type, convert: Convert, fast: bool,
           make: Callable[[list], Any]) -> Convert:
    def each(v: Any) -> Any:
        if not isinstance(v, kind):
            raise Mismatch(f"expected {shown}, got {type(v).__name__}")
        # The hot case, token ids and block hashes, skips the per-item loop.
        if fast and all(type(x) is int for x in v):
            return make(v)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(convert(x))
            except Mismatch as exc:
                raise exc.within(f"[{i}]") from None
        return make(out)

    return each


def _same(v: list) -> list:  # a list of ints travels as it is; others were rebuilt
    return v


def _sequence(item_annotation: Any, tuple_out: bool) -> FieldType:
    item = field_type(item_annotation)
    shown = f"tuple[{item.name}, ...]" if tuple_out else f"list[{item.name}]"
    fast = item_annotation is int
    if tuple_out:  # a tuple in the record, a list on the wire
        return FieldType(shown, _items(shown, tuple, item.to_wire, fast, list),
                         _items(shown, list, item.from_wire, fast, tuple))
    return FieldType(shown, _items(shown, list, item.to_wire, fast, _same),
                     _items(shown, list, item.from_wire, fast, _same))


def _optional(inner: FieldType) -> FieldType:
    def wrap(convert: Convert) -> Convert:
        return lambda v: None if v is None else convert(v)

    return FieldType(f"{inner.name} | None", wrap(inner.to_wire), wrap(inner.from_wire))


def _nested(spec: RecordSpec) -> FieldType:
    def to_wire(v: Any) -> Any:
        if type(v) is not spec.cls:
            raise Mismatch(f"expected {spec.type_name}, got {type(v).__name__}")
        return body_to_wire(spec, v)

    def from_wire(v: Any) -> Any:
        if not isinstance(v, dict):
            raise Mismatch(f"expected {spec.type_name} (a map), got {type(v).__name__}")
        return body_from_wire(spec, v)

    return FieldType(spec.type_name, to_wire, from_wire)


def field_type(annotation: Any) -> FieldType:
    """The FieldType of an allowed annotation; TypeError for any other."""
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if annotation in NESTED:
        return _nested(NESTED[annotation])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1 and (args[0] in _LIST_ITEMS or args[0] in NESTED):
        return _sequence(args[0], tuple_out=False)
    if origin is tuple and args == (int, ...):
        return _sequence(int, tuple_out=True)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return _optional(field_type(args[0] if args[1] is type(None) else args[1]))
    raise TypeError(f"unsupported field type {annotation!r}")


def record_spec(type_name: str, cls: type) -> RecordSpec:
    """The spec of a frozen, slotted dataclass; TypeError if it is not one or a field's
    annotation is not allowed."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} must be a frozen, slotted dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(FieldSpec(f.name, field_type(hints[f.name]), required))
    return RecordSpec(type_name, cls, tuple(specs), frozenset(f.name for f in specs))


def body_to_wire(spec: RecordSpec, record: Any) -> dict:
    """The fields of ``record`` as msgpack packs them; Mismatch names the bad field."""
    body = {}
    for f in spec.fields:
        try:
            body[f.name] = f.type.to_wire(getattr(record, f.name))
        except Mismatch as exc:
            raise exc.within(f".{f.name}") from None
    return body


class MissingField(Mismatch):
    """A required field is absent (``missing_field`` at the top level)."""


def body_from_wire(spec: RecordSpec, body: dict) -> Any:
    """The record ``body`` describes; unknown keys are ignored. Mismatch names the bad
    field; a record whose own checks refuse the values (ValueError, TypeError) too."""
    values = {}
    for key in body.keys() - spec.names:  # the keys it ignores are bounded too
        check_depth(body[key], f"unknown field {key!r}")
    for f in spec.fields:
        if f.name not in body:
            if f.required:
                raise MissingField(f"missing field {f.name!r}")
            continue
        try:
            values[f.name] = f.type.from_wire(body[f.name])
        except MissingField as exc:  # inside a nested record: its type is wrong
            raise Mismatch(exc.detail, f".{f.name}{exc.path}") from None
        except Mismatch as exc:
            raise exc.within(f".{f.name}") from None
    try:
        return spec.cls(**values)
    except (TypeError, ValueError) as exc:
        raise Mismatch(str(exc)) from None

