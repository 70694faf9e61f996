"""The control plane's codec: message envelope, field checking, encode and decode.

Messages are declared in :mod:`common.protocol` with :func:`message`, the nested records
their fields carry with :func:`record`; this module knows how any of them travels, not
which exist. What each field annotation allows is :mod:`common.codec_types`.

Wire format (one ZeroMQ multipart message)::

    frame 0    msgpack map {"v": PROTOCOL_VERSION, "type": str, "id": str,
                            "parent": str | nil, "rid": str | nil, "body": {field: value},
                            "trace": str (optional: a W3C traceparent)}
    frame 1..  raw bulk bytes, never interpreted by the codec

Contract of the codec:

- ``encode`` checks every field against its annotation and raises ``ProtocolError``
  ("wrong_type") for a value msgpack cannot carry as declared: no object is ever pickled.
- ``decode`` raises ``ProtocolError`` whose ``code`` says what was wrong (a nested value
  with its path, ``generate.sampling.top_k: ...``), and nothing else for any bytes; it
  never returns a record whose fields, nested ones included, do not match their
  annotations.
- Body fields a record does not know are ignored, so a newer sender may add optional
  fields without breaking older receivers. Removing a field or changing its type is a
  version change (``PROTOCOL_VERSION``).

This module is transport-free (no zmq import) and must never import torch or numpy.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from common.codec_types import (
    NESTED,
    Mismatch,
    MissingField,
    RecordSpec,
    TooDeep,
    body_from_wire,
    body_to_wire,
    is_int,
    record_spec,
)
from common.tracing import parse_traceparent

PROTOCOL_VERSION: int = 2
MAX_FRAME_BYTES: int = 64 << 20  # default limit for frame 0, the envelope
MAX_BULK_FRAME_BYTES: int = 1 << 30  # default limit for each bulk frame

ERROR_CODES: frozenset[str] = frozenset(
    {"malformed", "unknown_type", "version", "missing_field", "wrong_type", "oversized"}
)


class ProtocolError(ValueError):
    """A message that cannot be encoded or decoded.

    ``code`` is one of ``ERROR_CODES``. ``envelope`` is set when the header was readable
    (so a server can address its ``Error`` reply to the offending request), else None.
    """

    def __init__(self, code: str, message: str, *, envelope: Envelope | None = None):
        if code not in ERROR_CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.envelope = envelope

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


@dataclass(frozen=True, slots=True)
class Envelope:
    """Header of every message; ``parent`` is the id of the message this one answers,
    ``trace`` the request's trace context (a valid traceparent or None)."""

    type: str
    id: str
    parent: str | None
    request_id: str | None
    version: int
    trace: str | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message. ``bulk`` views are valid as long as the Message is held."""

    envelope: Envelope
    record: Any
    bulk: list[memoryview]


# --- registration ------------------------------------------------------------------------

_BY_NAME: dict[str, RecordSpec] = {}
_BY_CLASS: dict[type, RecordSpec] = {}


def message(type_name: str) -> Callable[[type], type]:
    """Register a frozen, slotted dataclass as the record for message type ``type_name``.

    Raises TypeError if the class is not such a dataclass, a field's annotation is not an
    allowed type (:mod:`common.codec_types`), or ``type_name`` (or the class) is already
    registered.
    """

    def register(cls: type) -> type:
        if type_name in _BY_NAME or cls in _BY_CLASS or cls in NESTED:
            raise TypeError(f"message type {type_name!r} ({cls.__name__}) registered twice")
        spec = record_spec(type_name, cls)
        _BY_NAME[type_name] = spec
        _BY_CLASS[cls] = spec
        return cls

    return register


def record(cls: type) -> type:
    """Register a frozen, slotted dataclass as a nested record: a field type of messages
    (and of other nested records, declared before it), travelling as a map of its fields.

    It is not a message: it has no type name of its own and cannot be sent alone.
    Raises TypeError as :func:`message` does.
    """
    if cls in NESTED or cls in _BY_CLASS:
        raise TypeError(f"record {cls.__name__} registered twice")
    NESTED[cls] = record_spec(cls.__name__, cls)
    return cls


def records() -> dict[str, type]:
    """The nested records: class name -> class."""
    return {cls.__name__: cls for cls in NESTED}


def registry() -> dict[str, type]:
    """A copy of the registry: message type name -> record class."""
    return {name: spec.cls for name, spec in _BY_NAME.items()}


# --- codec -------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _as_view(frame: Any, index: int) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    if isinstance(frame, bytes | bytearray):
        return memoryview(frame)
    buffer = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq here
    if isinstance(buffer, memoryview):
        return buffer
    raise ProtocolError("malformed", f"frame {index} is not bytes-like: {type(frame).__name__}")


def encode(
    record: Any,
    *,
    request_id: str | None = None,
    parent: str | None = None,
    msg_id: str | None = None,
    bulk: Sequence[bytes | memoryview] = (),
    trace: str | None = None,
) -> list[bytes | memoryview]:
    """Frames for ``record``: the msgpack envelope, then ``bulk`` unchanged (not copied).
    ``trace`` (a traceparent) is sent only when set, and only if valid.

    Raises TypeError if ``record`` is not a registered record or a bulk item is not
    bytes-like; ProtocolError "wrong_type" if a field does not match its annotation or
    holds something msgpack cannot encode; "oversized" if the envelope exceeds
    ``MAX_FRAME_BYTES``.
    """
    spec = _BY_CLASS.get(type(record))
    if spec is None:
        raise TypeError(f"{type(record).__name__} is not a registered message record")
    for name, value in (("request_id", request_id), ("parent", parent), ("msg_id", msg_id)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be str or None, got {type(value).__name__}")
    try:
        body = body_to_wire(spec, record)
    except Mismatch as exc:
        raise ProtocolError("wrong_type", f"{spec.type_name}{_at(exc)}") from None
    head = {
        "v": PROTOCOL_VERSION,
        "type": spec.type_name,
        "id": msg_id if msg_id is not None else uuid.uuid4().hex,
        "parent": parent,
        "rid": request_id,
        "body": body,
    }
    if (trace := parse_traceparent(trace)) is not None:
        head["trace"] = trace
    try:
        frame0 = msgpack.packb(head, use_bin_type=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(
            "wrong_type",
            f"{spec.type_name}: a field holds a value msgpack cannot encode ({exc});"
            " objects are never pickled",
        ) from None
    if len(frame0) > MAX_FRAME_BYTES:
        raise ProtocolError(
            "oversized", f"{spec.type_name}: envelope is {len(frame0)} bytes > {MAX_FRAME_BYTES}"
        )
    frames: list[bytes | memoryview] = [frame0]
    for i, item in enumerate(bulk):
        if not isinstance(item, bytes | bytearray | memoryview):
            raise TypeError(f"bulk item {i} is not bytes-like: {type(item).__name__}")
        frames.append(item)
    return frames


def _read_envelope(head: dict) -> Envelope | None:
    """The envelope if its header fields have the right types, else None."""
    version, kind, msg_id = head.get("v"), head.get("type"), head.get("id")
    parent, rid = head.get("parent"), head.get("rid")
    if not (is_int(version) and isinstance(kind, str) and isinstance(msg_id, str)):
        return None
    if not all(x is None or isinstance(x, str) for x in (parent, rid)):
        return None
    # A bad trace context is dropped, never an error: tracing must not cost a request.
    return Envelope(type=kind, id=msg_id, parent=parent, request_id=rid, version=version,
                    trace=parse_traceparent(head.get("trace")))


def _peek_envelope(frame: memoryview) -> Envelope | None:
    """The header of an oversized envelope, read while skipping over the body, so the
    sender can still be told which message was refused; None if it cannot be read."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=_reject_ext,
                                    max_buffer_size=frame.nbytes)
        unpacker.feed(frame)
        head = {}
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "body":
                unpacker.skip()
            else:
                head[key] = unpacker.unpack()
    except Exception:  # best effort only: the frame is refused either way
        return None
    return _read_envelope(head)


def decode(
    frames: Sequence[Any],
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_bulk_bytes: int = MAX_BULK_FRAME_BYTES,
) -> Message:
    """The Message carried by ``frames`` (bytes, memoryview or zmq.Frame).

    Checks, in this order, raising ProtocolError with code:

    1. "malformed": no frames, or a frame that is not bytes-like;
    2. "oversized": frame 0 longer than ``max_frame_bytes`` (checked before unpacking);
    3. "malformed": frame 0 not one msgpack map, or ``v``/``type``/``id`` absent or of the
       wrong type, or ``parent``/``rid`` neither str nor nil (absent means nil);
    4. "version": ``v`` is not PROTOCOL_VERSION;
    5. "unknown_type": ``type`` is not registered;
    6. "malformed": ``body`` is not a map;
    7. "oversized": a bulk frame longer than ``max_bulk_bytes``;
    8. "missing_field" / "wrong_type": per field, in declaration order.

    From step 4 on the error carries the envelope; at step 2 it does when the header can
    be read without unpacking the body. Floats accept ints (made float). A plain value
    nested too deep is "malformed". No other exception leaves ``decode``, whatever the
    bytes.
    """
    try:
        return _decode(frames, max_frame_bytes, max_bulk_bytes)
    except ProtocolError:
        raise
    except Exception as exc:  # a bug's last line of defence: bad input never crashes a loop
        raise ProtocolError("malformed", f"undecodable message: {exc!r}") from None


def _at(exc: Exception) -> str:
    """How a field error continues the record's name: ``.field...: detail``."""
    return str(exc) if str(exc).startswith((".", "[")) else f": {exc}"


def _decode(frames: Sequence[Any], max_frame_bytes: int, max_bulk_bytes: int) -> Message:
    if len(frames) == 0:
        raise ProtocolError("malformed", "no frames")
    views = [_as_view(f, i) for i, f in enumerate(frames)]
    if views[0].nbytes > max_frame_bytes:
        raise ProtocolError(
            "oversized", f"envelope frame is {views[0].nbytes} bytes > {max_frame_bytes}",
            envelope=_peek_envelope(views[0]),
        )
    try:
        head = msgpack.unpackb(
            views[0], raw=False, strict_map_key=False, ext_hook=_reject_ext, timestamp=0
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError("malformed", f"envelope is not valid msgpack: {exc}") from None
    if not isinstance(head, dict):
        raise ProtocolError("malformed", f"envelope is a {type(head).__name__}, not a map")
    env = _read_envelope(head)
    if env is None:
        raise ProtocolError("malformed", "envelope header fields missing or of the wrong type")
    if env.version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"version {env.version}, expected {PROTOCOL_VERSION}", envelope=env
        )
    spec = _BY_NAME.get(env.type)
    if spec is None:
        raise ProtocolError("unknown_type", f"unknown message type {env.type!r}", envelope=env)
    body = head.get("body")
    if not isinstance(body, dict):
        raise ProtocolError("malformed", f"{env.type}: body is not a map", envelope=env)
    for i, view in enumerate(views[1:], start=1):
        if view.nbytes > max_bulk_bytes:
            raise ProtocolError(
                "oversized", f"bulk frame {i} is {view.nbytes} bytes > {max_bulk_bytes}",
                envelope=env,
            )
    try:
        rec = body_from_wire(spec, body)
    except MissingField as exc:
        raise ProtocolError("missing_field", f"{env.type}: {exc}", envelope=env) from None
    except TooDeep as exc:
        raise ProtocolError("malformed", f"{env.type}{_at(exc)}", envelope=env) from None
    except Mismatch as exc:
        raise ProtocolError("wrong_type", f"{env.type}{_at(exc)}", envelope=env) from None
    return Message(envelope=env, record=rec, bulk=views[1:])
