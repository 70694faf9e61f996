"""What a decode worker keeps per request, shared by its role and the parts that move
requests in and out of it (``migrate_in.py``, ``migrate_out.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from common.protocol import Error, KVAdvert, Timing
from common.tracing import Span
from common.transfer import MultiReceiver, Transfer
from services.engine.outputs import RemoteSlots
from services.worker.context import RoleContext
from services.worker.tombstones import Tombstones


@dataclass(slots=True)
class Stream:
    request_id: str
    addr: str
    start_position: int
    prompt_token_ids: list[int]
    cache_salt: str | None
    next_position: int = 0  # of the next token this worker sends (set once it sends)
    span: Span | None = None  # decode.request: the parent of this worker's spans
    # Stage clocks (time.monotonic()): see stage_timing.
    arrived: float = 0.0
    asked: float | None = None  # Prefill sent
    kv_done: float | None = None  # all KV here and PrefillDone in
    first: float | None = None  # a prompt prefilled here: its first token
    queued: float = 0.0  # a prompt prefilled here: its wait in the engine's queue
    measured: Timing | None = None  # the prefill worker's own stages
    finished: bool = False  # its last token went out (it left ``streams`` so, not aborted)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Remote:
    """KV arriving into reserved blocks: from a prefill worker, or from a stopping decode
    worker (``prefill_addr`` empty: nobody to tell of an abort)."""

    slots: RemoteSlots
    transfer: Transfer
    prefill_addr: str
    started: float


class DecodeParts(Protocol):
    """What the migration parts use of the decode role."""

    ctx: RoleContext
    streams: dict[str, Stream]
    remote: dict[str, Remote]
    receiver: MultiReceiver
    aborted: Tombstones
    leaving: bool

    def overloaded(self) -> Error | None: ...

    def kv_advert(self) -> KVAdvert: ...
