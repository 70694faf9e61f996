"""The engine on its own thread, driven from an asyncio event loop.

The engine is not thread-safe, and a step can take a while; so one thread owns it,
from the start: that thread builds it (a model load can take minutes, during which the
event loop keeps answering signals), then serves it.
Calls from the event loop (add a request, abort, export KV, …) are queued and run on
that thread between steps; each step's outputs are handed back to the event loop.

    event loop ── run(fn) ──► [command queue] ──► engine thread: fn(engine), step, …
    event loop ◄── on_outputs(outputs, step_seconds) ◄──────────────┘

Nothing else holds the engine: its parts reach it through ``run`` (reads and writes
alike), read its fixed facts from ``facts``, and its load from ``load``. Two calls touch
the KV store off the command queue, each where no step can race it: ``export_layer``
from an engine hook (the engine thread itself) and ``import_layer`` (or a write through
``landing``'s views) from the data plane's sink (see there).

Each step is also kept as a timing sample for the conductor's cost model: a step that
only prefilled as a prefill sample, one that only decoded as a decode sample (a step
that did both fits neither model and is dropped). ``take_samples`` hands over those
gathered since the last call; at most ``MAX_SAMPLES`` of each kind, the newest.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import structlog

from common.protocol import StepSample
from services.engine.outputs import EngineDeadError, RequestOutput
from services.engine.sequence import SequenceStatus
from services.worker.kv_landing import KVLanding

if TYPE_CHECKING:
    from services.engine.core import EngineCore

log = structlog.get_logger(__name__)


class PendingExport(Protocol):
    """An export on its way to the host (``services.engine.host_buffers.PendingBytes``)."""

    def ready(self) -> bool: ...

    def wait(self) -> memoryview: ...


class ExportedNow(NamedTuple):
    """An export whose bytes were there at once."""

    view: memoryview

    def ready(self) -> bool:
        return True

    def wait(self) -> memoryview:
        return self.view


async def exported_bytes(pending: Any) -> Any:
    """An export's bytes (``wait()``) once its copy off the device is done: waited for on
    a thread so the event loop goes on meanwhile; at once when they are already there
    (the CPU)."""
    if not pending.ready():
        await asyncio.to_thread(pending.wait)
    return pending.wait()


OutputHandler = Callable[[list[RequestOutput], float], None]
MAX_SAMPLES = 32
MAX_ADMITTED = 1024  # request ids a heartbeat acknowledges; older ones the conductor ages out
T = TypeVar("T")


class EngineFacts(NamedTuple):
    """What never changes once the engine is built; safe to read from anywhere."""

    block_size: int
    num_blocks: int
    num_layers: int
    block_nbytes: int  # one block across all layers
    fingerprint: str


class LoadSnapshot(NamedTuple):
    """The engine's load, refreshed on the engine thread; safe to read from anywhere."""

    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    num_requests: int = 0
    waiting_for_kv: int = 0  # remote prefills whose KV has not all landed
    reserved_blocks: int = 0  # blocks held requests will still take for their output
    admitted: int = 0  # requests taken in so far, all counted above (``take_admitted``)


class EngineLoop:
    def __init__(self, on_outputs: OutputHandler, *, name: str = "engine") -> None:
        self._engine: EngineCore | None = None
        self._facts: EngineFacts | None = None
        self._landing: KVLanding | None = None  # set once built, where the cache allows
        self._on_outputs = on_outputs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead = False  # a tensor-parallel rank died: no step can run again
        self._loop: asyncio.AbstractEventLoop | None = None
        self.step_times: collections.deque[float] = collections.deque(maxlen=32)
        self._prefill_samples: collections.deque[StepSample] = collections.deque(
            maxlen=MAX_SAMPLES)
        self._decode_samples: collections.deque[StepSample] = collections.deque(maxlen=MAX_SAMPLES)
        self.prefill_tokens_per_s = 0.0  # smoothed over prefill-only steps; 0: none yet
        self.load = LoadSnapshot()
        # Request ids in the order snapshots first counted them, numbered: a heartbeat
        # acknowledges exactly those its snapshot counts (engine thread appends, the
        # heartbeat pops; deques are thread-safe for that).
        self._known: set[str] = set()
        self._admitted: collections.deque[tuple[int, str]] = collections.deque(
            maxlen=MAX_ADMITTED)
        self._admitted_n = 0

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("the engine is not built yet")
        return self._facts

    @property
    def built(self) -> bool:
        """Whether the engine exists (its build finished)."""
        return self._facts is not None

    async def start(self, build: Callable[[], EngineCore]) -> None:
        """Start the engine thread, which calls ``build`` and then serves the engine;
        return once it is built, or raise what ``build`` raised. Cancelling this wait
        leaves the build running: the thread is a daemon, so it holds no process up,
        and it ends after the build if ``stop`` was called meanwhile."""
        self._loop = asyncio.get_running_loop()
        built = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name=self._name, daemon=True)
        self._thread.start()
        await built

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None and self._engine is not None:
            await asyncio.to_thread(self._thread.join, 10)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the engine thread; its result or exception."""
        if self._loop is None:
            raise RuntimeError("engine loop not started")
        future = self._loop.create_future()
        self._commands.put((fn, args, kwargs, future))
        return await future

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(engine, *args, **kwargs)`` on the engine thread; its result or exception."""
        return await self.call(fn, self._engine, *args, **kwargs)

    def export_layer(self, layer: int, block_ids: Sequence[int]) -> memoryview:
        """Layer ``layer`` of ``block_ids`` as bytes. Engine thread only (an engine hook
        streaming a prompt's KV out while the next layer computes)."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("export_layer runs on the engine thread only")
        return self._engine.kv_store.export_layer_bytes(layer, block_ids)

    def export_layer_async(self, layer: int, block_ids: Sequence[int]) -> PendingExport:
        """:meth:`export_layer`, started: on a GPU the copy to the host runs on a side
        stream while the next layer computes (``KVCache.export_layer_async``); a store
        without that (the CPU, which shares memory, or tensor parallelism) exports now.
        Engine thread only; ``wait()`` the result anywhere."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("export_layer_async runs on the engine thread only")
        store = self._engine.kv_store
        start = getattr(store, "export_layer_async", None)
        if start is None:
            return ExportedNow(store.export_layer_bytes(layer, block_ids))
        return start(layer, block_ids)

    def export_local_slice(self, layer: int, block_ids: Sequence[int]) -> ExportedNow:
        """Rank 0's own KV heads of ``layer`` for ``block_ids``: its part of a direct
        send (``services/engine/tp_direct.py``). Engine thread only."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError("export_local_slice runs on the engine thread only")
        return ExportedNow(self._engine.kv_store.export_local_layer(layer, block_ids))

    def import_layer(self, layer: int, block_ids: Sequence[int], payload: memoryview) -> None:
        """Write received KV into ``block_ids``, from the event loop, without waiting for
        a step to end (the payload is only borrowed for the data plane's sink call).

        Only for blocks reserved for a request waiting for its KV: no step reads or
        frees them until ``complete_remote_prefill``, ``cancel_remote_prefill`` or
        ``abort``, and the caller stops writing (drops the request from what it
        expects) before it asks for any of those."""
        self._engine.kv_store.import_layer_bytes(layer, block_ids, payload)

    @property
    def lands(self) -> bool:
        """Whether ``landing`` can name views (the built engine's cache allows them)."""
        return self._landing is not None

    def landing(self, layer: int, block_ids: Sequence[int],
                nbytes: int) -> list[memoryview] | None:
        """Writable views of ``block_ids``' K, then V, in ``layer``, where the data plane
        may copy a received chunk (``kv_landing.py``); None where the cache is not laid
        out for it. ``import_layer``'s rules hold for what is written through them."""
        landing = self._landing
        return None if landing is None else landing.views(layer, block_ids, nbytes)

    def landing_many(self, layers: Sequence[int], block_ids: Sequence[int],
                     sizes: Sequence[int]) -> list[memoryview] | None:
        """``landing`` for several layers' chunks of the same ``block_ids``, back to back."""
        landing = self._landing
        return None if landing is None else landing.views_many(layers, block_ids, sizes)

    def import_layer_slice(self, layer: int, block_ids: Sequence[int],
                           heads: tuple[int, int, int], payload: memoryview) -> None:
        """``import_layer`` for one tensor-parallel rank's slice of the KV heads (the same
        rules); ``ValueError`` for an engine whose store takes no slices (TP > 1)."""
        store = self._engine.kv_store
        take = getattr(store, "import_layer_slice_bytes", None)
        if take is None:
            raise ValueError("this engine takes KV head slices only with one rank")
        take(layer, block_ids, heads, payload)

    def recent_step_ms(self) -> float:
        return 1000 * sum(self.step_times) / len(self.step_times) if self.step_times else 0.0

    def take_samples(self) -> tuple[list[StepSample], list[StepSample]]:
        """(prefill, decode) step samples since the last call, oldest first; thread-safe
        (deque appends and pops are atomic)."""
        out = []
        for samples in (self._prefill_samples, self._decode_samples):
            taken = []
            while samples:
                taken.append(samples.popleft())
            out.append(taken)
        return out[0], out[1]

    def _record(self, elapsed: float) -> None:
        step = self._engine.last_step
        if step is None:
            return
        # Per-step trace (worker log_level = "debug"): what each step carried and cost.
        log.debug("step", ms=round(elapsed * 1e3, 2), decode=step.decode_batch,
                  prefill=sum(n for n, _ in step.prefill), chunks=len(step.prefill))
        if step.prefill and not step.decode_batch:
            rate = sum(n for n, _ in step.prefill) / max(elapsed, 1e-9)
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if not old else 0.8 * old + 0.2 * rate
            self._prefill_samples.append(StepSample(
                seconds=elapsed, tokens=[n for n, _ in step.prefill],
                cached=[c for _, c in step.prefill]))
        elif step.decode_batch and not step.prefill:
            self._decode_samples.append(StepSample(
                seconds=elapsed, batch=step.decode_batch, context=step.decode_context))

    def _settle(self, future: asyncio.Future, result: Any = None,
                exc: BaseException | None = None) -> None:
        def apply() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)
        # A build abandoned by a stop may end after the event loop has closed.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(apply)

    def _run_command(self, item) -> None:
        fn, args, kwargs, future = item
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller, never kills the thread
            self._settle(future, exc=exc)
        else:
            self._settle(future, result)

    def _snapshot(self) -> LoadSnapshot:
        engine, sched = self._engine, self._engine.scheduler
        queued = sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting)
        queued += sum(s.num_prompt_tokens - s.num_computed_tokens for s in sched.running
                      if s.num_computed_tokens < s.num_prompt_tokens)
        bm = engine.block_manager
        known = self._known
        if len(known) != len(engine.requests) or not known.issuperset(engine.requests):
            for rid in engine.requests:
                if rid not in known:
                    self._admitted_n += 1
                    self._admitted.append((self._admitted_n, rid))
            self._known = set(engine.requests)
        awaiting = reserved = 0
        # A held request's blocks for its remaining output are spoken for: a conductor
        # reading only the free count would promise them to the next request.
        for s in engine.requests.values():
            if s.status is SequenceStatus.WAITING_FOR_KV:
                awaiting += 1
            elif s.status is not SequenceStatus.RUNNING:
                continue
            final = s.num_prompt_tokens + s.params.max_tokens
            reserved += max(0, -(-final // bm.block_size) - len(s.block_table))
        return LoadSnapshot(len(sched.waiting), len(sched.running), queued,
                            bm.num_free_blocks, bm.num_blocks, len(engine.requests),
                            awaiting, reserved, self._admitted_n)

    def take_admitted(self, load: LoadSnapshot) -> list[str]:
        """The request ids first counted by ``load`` or an earlier snapshot, not taken
        before, oldest first: what a heartbeat carrying ``load`` acknowledges."""
        taken, pending = [], self._admitted
        while pending and pending[0][0] <= load.admitted:
            taken.append(pending.popleft()[1])
        return taken

    def _run(self, build: Callable[[], EngineCore], built: asyncio.Future) -> None:
        try:
            engine = build()
        except BaseException as exc:  # the caller of start() raises it
            self._settle(built, exc=exc)
            return
        self._facts = EngineFacts(engine.block_manager.block_size,
                                  engine.block_manager.num_blocks, engine.kv_store.num_layers,
                                  engine.kv_store.block_nbytes, engine.fingerprint)
        self._landing = KVLanding.of(engine.kv_store)
        self._engine = engine
        self.load = self._snapshot()
        self._settle(built)
        self._serve()

    def _serve(self) -> None:
        while not self._stopping:
            self.load = self._snapshot()
            busy = self._engine.has_unfinished_requests() and not self._dead
            try:
                item = self._commands.get(block=not busy, timeout=None if not busy else 0)
            except queue.Empty:
                item = False
            if item is None:
                break
            if item:
                self._run_command(item)
                while True:  # drain everything queued before stepping again
                    try:
                        item = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._run_command(item)
            if not self._engine.has_unfinished_requests() or self._dead:
                continue
            if item:  # what was just added is part of the load while this step runs
                self.load = self._snapshot()
            start = time.perf_counter()
            try:
                outputs = self._engine.step()
            except EngineDeadError:
                # Not the requests' fault: left unfinished, they are re-routed by their
                # gateways once this worker is gone (it exits, its heartbeats stop),
                # rather than ended with an error the client would see.
                log.exception("engine is dead; its requests are left to fail over")
                self._dead = True
                continue
            except Exception as exc:  # a broken step must not take the process down
                log.exception("engine step failed")
                outputs = self._fail_all(str(exc))
                elapsed = time.perf_counter() - start
            else:
                elapsed = time.perf_counter() - start
                self._record(elapsed)
            self.step_times.append(elapsed)
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs, elapsed)

    def _fail_all(self, reason: str) -> list[RequestOutput]:
        """Abort every running request after a failed step, reporting each as an error."""
        failed = []
        for rid, seq in list(self._engine.requests.items()):
            if self._engine.abort(rid):
                failed.append(RequestOutput(rid, [], len(seq.output_token_ids), finished=True,
                                            finish_reason="error",
                                            num_prompt_tokens=seq.num_prompt_tokens))
        return failed
