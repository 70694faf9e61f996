"""KV transfer throughput of each backend between two processes, against the physical
limit it is held to, measured in the same run:  python bench/transfer.py [--sizes 1,16,256]
(then ``python bench/report.py`` rewrites docs/benchmarks.md's data-plane tables)

Payloads: a request's whole KV in the default model's layout (30 layers, 16-token blocks,
3 KV heads x 64 dims, fp32: 46,080 bytes a token), rounded up to whole blocks, sent as one
chunk per layer for non-contiguous block ids, all handed to one ``send_many`` (tcp and shm
send them as batches of up to 2 and 4 MiB: ``common/transfer/batch.py``), then ``finish``.
Every receiver lands the bytes in a destination buffer once, as a decode worker lands
them in its KV blocks: tcp, its read out of the socket (the sink then does nothing); shm,
a copy of each message out of the segment into the destination the sink names
(``LandingSink``: the receiver copies and checksums in one pass where its kernel is
built, else it hashes the segment and the sink copies). Figures are medians over
repetitions after a warm-up, backend and limit alternating. Each transfer ends when its
sender knows that all of it landed: a backend's at its verdict (``finish``), a limit's,
which has none, when the receiving process says so (a stdout line); the backend's
receiving process prints one such line a round (its CPU figure), read then. A round
of each side is as many whole transfers, one after another, as make ``--round-mib`` (32
MiB: 23 transfers of 1.4 MiB, two of 16 MiB, one of 256 MiB), the same count on both sides;
``--round-mib 0`` times one transfer a round.

Limits: tcp, blocking ``sendall`` of each layer / ``recv_into`` one buffer; shm,
``memcpy`` of each layer into a pre-faulted segment the receiver maps, a pipe line to
wake it after each group of layers (``shm_groups``: two at 1 MiB, eight at 16 MiB, as
many as there are layers at 256 MiB, so that its copy out of one group overlaps the copy
in of the next as the backend's batches do), and its copy of each layer out of the
segment into a destination buffer; ucx,
the whole payload in one ucxx send. Goals (``goal``): tcp and shm at least 0.7x the limit at 1 MiB
and 0.85x at 16 MiB, tcp 0.9x at 256 MiB; ucx is reported beside them. The limit moves
the same bytes in the same messages (one per layer, the same sizes) between the same two
kinds of process, and its receiver says it has all the same way.

Every backend checks each batch end to end (xxh3_64, which a raw socket does not), so
tcp is also run against its limit checked (``checked``, bench/transfer_limits.py): the
same sends in the backend's batches, each hashed before it goes and again as it is read.
Its ratio says what is left to the backend's own work once the check is paid. Writes
bench/results/transfer.* and one harness report per cell, transfer-<kind>-<mib>mib.json.
The limits are in
bench/transfer_limits.py, the backend's receiving process in bench/transfer_serve.py.

Both processes run on uvloop where it is installed, as every service does
(common/service_main.py); ``PDSERVE_BENCH_LOOP=asyncio`` measures on the plain loop.
A loop turn's own cost is part of every message's, so each cell's settings name the
loop it was measured on (``loop``).

Runs on bench/harness.py: backend and limit interleaved round by round, the ratio taken
per round, its median and spread reported, the machine and its load recorded. Besides
the wall time, each side reports the CPU time both processes spent per transfer, which a
busy machine moves much less than the wall time: on a shared machine compare that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import Metric, Session, write  # noqa: E402
from bench.machine import load_average, machine_line  # noqa: E402
from bench.transfer_limits import (  # noqa: E402
    CHECKED_LIMITS,
    CHECKED_NAME,
    LIMIT_NAMES,
    LIMITS,
    serve_raw_shm,
    serve_raw_tcp,
    serve_raw_ucx,
)
from bench.transfer_serve import LAYERS, serve_backend  # noqa: E402

LAYOUT = {"layers": LAYERS, "block_tokens": 16, "kv_heads": 3, "head_dim": 64, "dtype": "float32"}
BLOCK_LAYER_BYTES = 2 * 16 * 3 * 64 * 4  # K and V of one block in one layer
MIB = 1 << 20
# A round of one 1.4 MiB transfer lasts about a millisecond: one burst of other work moves
# its ratio 2-3x either way. Rounds of several transfers, as many a side, average that out.
ROUND_MIB = 32.0


def goal(kind: str, mib: int) -> float | None:
    """The ratio to the limit this backend should reach at this size (None: no goal)."""
    if kind == "ucx" or (kind == "shm" and mib > 16):
        return None
    return 0.7 if mib <= 1 else 0.85 if mib <= 16 else 0.9


class Peer:
    """A receiving process: its first line is its address, then one line a repetition,
    ending with the CPU seconds the process has used so far (``cpu``: at the last one)."""

    cpu = 0.0

    async def done(self) -> str:
        """The next repetition's line, less its CPU figure; ``cpu_spent`` the CPU it took."""
        line = await self.line()
        head, _, cpu = line.rpartition(" ")
        self.cpu_spent, self.cpu = float(cpu) - self.cpu, float(cpu)
        return head

    async def start(self, *args: str) -> str:
        pipe = asyncio.subprocess.PIPE
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve", *args, cwd=ROOT, stdin=pipe, stdout=pipe,
            limit=1 << 20)  # the tokens line: 33 bytes a transfer
        return (await self.line()).removeprefix("addr ")

    async def line(self) -> str:
        if raw := await asyncio.wait_for(self.proc.stdout.readline(), 120):
            return raw.decode().strip()
        raise RuntimeError("the receiving process died")

    async def stop(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()


@contextlib.asynccontextmanager
async def backend(peer: Peer, kind: str, chunks, blocks: list[int], reps: int, per_round: int):
    from common.transfer import make_sender

    sender = make_sender(kind)
    address = await peer.start("backend", kind, str(reps), str(per_round))
    tokens = [bytes.fromhex(t) for t in (await peer.line()).removeprefix("tokens ").split(",")]

    layers = [(layer, blocks, chunk) for layer, chunk in enumerate(chunks)]
    unread: list[int] = []

    async def one(rep: int) -> None:
        # The request's layers at hand: one call, sent in batches where the backend can.
        await sender.send_many(address, f"r{rep}", layers, token=tokens[rep])
        # Its verdict says every byte landed and checked: what a sender waits for.
        await sender.finish(address, f"r{rep}", len(chunks), token=tokens[rep])
        unread.append(rep)

    async def settle() -> None:
        """The receiving process's line for the round (its CPU figure), read once a round:
        after the round's last transfer (several() runs whole rounds), all done there."""
        if unread:
            rep, unread[:] = unread[-1], []
            if await peer.done() != f"done r{rep}":
                raise RuntimeError(f"{kind} transfer r{rep} did not complete")

    one.settle = settle
    try:
        yield one
    finally:
        await sender.close()


# What each side's sender waits for before its next transfer.
TRANSFER_ENDS = {"backend": "its verdict (finish)", "limit": "the receiver's stdout line"}

METRICS = [Metric("gbps", "throughput", "GB/s"),
           Metric("cpu_ms", "CPU of both processes per transfer", "ms", higher_is_better=False),
           # Where that CPU goes: in which process a side's fixed per-request cost is spent.
           Metric("send_cpu_ms", "of it, the sending process", "ms", higher_is_better=False),
           Metric("recv_cpu_ms", "of it, the receiving process", "ms", higher_is_better=False)]


def measure_pair(runner: asyncio.Runner, kind: str, chunks, payload, blocks, repeats: int,
                 warmup: int, settings: dict, per_round: int = 1) -> dict:
    """The harness report of (backend, limit) for one backend and size, interleaved;
    each side's round is ``per_round`` transfers, one after another."""
    peers, stack = (Peer(), Peer()), contextlib.AsyncExitStack()

    checked = CHECKED_LIMITS.get(kind)
    if checked is not None:
        peers += (Peer(),)

    async def open_all():
        ours = await stack.enter_async_context(
            backend(peers[0], kind, chunks, blocks, (warmup + repeats) * per_round, per_round))
        sides = {"backend": side(ours, peers[0]), "limit": side(
            await stack.enter_async_context(LIMITS[kind](peers[1], chunks, payload)), peers[1])}
        if checked is not None:
            sides["checked"] = side(
                await stack.enter_async_context(checked(peers[2], chunks, payload)), peers[2])
        return sides

    async def several(one, first: int) -> None:
        for rep in range(first, first + per_round):
            await one(rep)
        if settle := getattr(one, "settle", None):
            await settle()

    def side(one, peer: Peer):
        def run(ctx) -> dict:
            before = peer.cpu
            wall, cpu = time.perf_counter(), time.process_time()
            runner.run(several(one, ctx.round * per_round))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            send, recv = 1e3 * cpu / per_round, 1e3 * (peer.cpu - before) / per_round
            return {"gbps": per_round * payload.nbytes / wall / 1e9, "cpu_ms": send + recv,
                    "send_cpu_ms": send, "recv_cpu_ms": recv, "seconds": wall}
        return run

    try:
        sides = runner.run(open_all())
        if checked is not None:
            settings = {**settings, "checked": CHECKED_NAME, "transfer_ends": {
                **settings["transfer_ends"], "checked": TRANSFER_ENDS["limit"]}}
        session = Session(f"transfer-{kind}", settings=settings, log=lambda line: None)
        runs = session.run(sides, repeats=repeats, warmup=warmup)
        return session.finish(METRICS, runs)
    finally:
        runner.run(stack.aclose())
        for peer in peers:
            runner.run(peer.stop())


def measure(runner: asyncio.Runner, kinds: list[str], sizes: list[int], scale: float,
            out: Path, round_mib: float = ROUND_MIB) -> list:
    """One row per backend and size; each cell's harness report also goes to
    ``out/transfer-<kind>-<mib>mib.json``, which bench/report.py turns into its table in
    docs/benchmarks.md."""
    rows = []
    for mib in sizes:
        blocks = list(range(1, 3 * math.ceil(mib * MIB / (LAYERS * BLOCK_LAYER_BYTES)), 3))
        layer_bytes = len(blocks) * BLOCK_LAYER_BYTES
        repeats = max(3, round(scale * (31 if mib <= 16 else 4)))
        warmup = max(1, round(scale * (10 if mib <= 1 else 3 if mib <= 16 else 1)))
        copies = math.ceil(LAYERS * layer_bytes / MIB)
        payload = memoryview(os.urandom(MIB) * copies)[: LAYERS * layer_bytes]
        per_round = max(1, math.ceil(round_mib * MIB / payload.nbytes))
        chunks = [payload[i * layer_bytes : (i + 1) * layer_bytes] for i in range(LAYERS)]
        for kind in kinds:
            settings = {"backend": kind, "size_mib": mib, "bytes": payload.nbytes,
                        "messages": LAYERS, "message_bytes": layer_bytes,
                        "blocks": len(blocks), "transfers_per_round": per_round,
                        "limit": LIMIT_NAMES[kind], "goal": goal(kind, mib),
                        "transfer_ends": TRANSFER_ENDS,
                        "loop": type(runner.get_loop()).__module__.partition(".")[0]}
            report = measure_pair(runner, kind, chunks, payload, blocks, repeats, warmup,
                                  settings, per_round)
            write(report, out / f"transfer-{kind}-{mib}mib.json")
            ratio = report["ratios"]["backend/limit"]
            row = {"backend": kind, "size_mib": mib, "bytes": payload.nbytes,
                   "blocks": len(blocks), "goal": goal(kind, mib),
                   "backend_gbps": report["sides"]["backend"]["gbps"]["median"],
                   "limit_gbps": report["sides"]["limit"]["gbps"]["median"],
                   "ratio": ratio["gbps"]["median"], "ratio_spread": ratio["gbps"],
                   "backend_cpu_ms": report["sides"]["backend"]["cpu_ms"]["median"],
                   "limit_cpu_ms": report["sides"]["limit"]["cpu_ms"]["median"],
                   "cpu_ratio": ratio["cpu_ms"]["median"], "report": report}
            if checked := report["ratios"].get("backend/checked"):
                row["checked_gbps"] = report["sides"]["checked"]["gbps"]["median"]
                row["checked_ratio"] = checked["gbps"]["median"]
            rows.append(row)

            def med(side: str, key: str, sides=report["sides"]) -> float:
                return sides[side][key]["median"]
            print(f"{kind:>4} {mib:>4} MiB ({len(blocks):>3} blocks) "
                  f"{row['backend_gbps']:7.2f} GB/s  limit {row['limit_gbps']:7.2f} GB/s  "
                  f"{row['ratio']:4.2f}x [{ratio['gbps']['q1']:.2f}-{ratio['gbps']['q3']:.2f}, "
                  f"n={ratio['gbps']['n']}]  CPU {row['backend_cpu_ms']:.2f} vs "
                  f"{row['limit_cpu_ms']:.2f} ms ({row['cpu_ratio']:.2f}x; send "
                  f"{med('backend', 'send_cpu_ms'):.2f} vs {med('limit', 'send_cpu_ms'):.2f}, "
                  f"receive {med('backend', 'recv_cpu_ms'):.2f} vs "
                  f"{med('limit', 'recv_cpu_ms'):.2f})  " + (
                      f"{row['checked_ratio']:.2f}x of it checked ({row['checked_gbps']:.2f} "
                      "GB/s)  " if "checked_ratio" in row else "") + (
                      "no goal" if row["goal"] is None else f"goal {row['goal']}x "
                      f"{'met' if row['ratio'] >= row['goal'] else 'MISSED'}"),
                  flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt  # picks a file-only backend when there is no display

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5), layout="tight")
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["backend_gbps"] for r in rows], 0.4, label="backend")
    ax.bar([i + 0.2 for i in x], [r["limit_gbps"] for r in rows], 0.4, label="physical limit")
    for i, r in enumerate(rows):
        ax.text(i - 0.2, r["backend_gbps"], f"{r['ratio']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(list(x), [f"{r['backend']}\n{r['size_mib']} MiB" for r in rows], fontsize=8)
    ax.set(ylabel="GB/s", yscale="log", title="KV transfer between two processes (x: of limit)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def loop_factory():
    """The event loop a service runs on (uvloop where installed: common/service_main.py),
    for both processes: a loop's own cost per turn is part of a message's."""
    if os.environ.get("PDSERVE_BENCH_LOOP") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,256", help="payload sizes in MiB")
    parser.add_argument("--backends", default="", help="default: every available one")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--scale", type=float, default=1.0,
                        help="repeats and warm-ups times this (0.3: a quick look)")
    parser.add_argument("--round-mib", type=float, default=ROUND_MIB,
                        help="each side's round moves at least this many MiB, as whole "
                        "transfers one after another (0: one transfer a round)")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        structlog.configure(  # stdout carries this process's lines to the measuring one
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            # As a service configures it (common/logging.py): a log call that is filtered
            # out costs a method call, not a logger built anew each time.
            cache_logger_on_first_use=True)
        mode, kind, *rest = args.serve
        if mode == "backend" or kind == "ucx":
            serving = serve_backend(kind, *rest) if mode == "backend" else serve_raw_ucx(*rest)
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                return runner.run(serving)
        return serve_raw_tcp(*rest) if kind == "tcp" else serve_raw_shm(*rest)
    from common.transfer import BackendUnavailable, available_backends

    with contextlib.suppress(ImportError):  # a sender is a model worker, torch loaded:
        import torch  # noqa: F401  the shm sender stages with its copy-and-checksum kernel

        from kernels import cpu_copysum
        cpu_copysum.kernel(wait=True)  # built (or loaded) before the first transfer
    from common.transfer.ucx import load_ucxx

    kinds = args.backends.split(",") if args.backends else list(available_backends())
    if "ucx" in kinds:
        try:
            load_ucxx()
        except BackendUnavailable as exc:  # an optional package missing is no failure here
            print(f"skipping ucx: {exc}")
            kinds.remove("ucx")
    started, load_before = time.perf_counter(), load_average()
    out = Path(args.out)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        rows = measure(runner, kinds, [int(s) for s in args.sizes.split(",")], args.scale, out,
                       args.round_mib)
    machine = rows[0]["report"]["machine"] if rows else {}
    machine = {**machine, "load_before": load_before, "load_after": load_average()}
    meta = {"cpus": os.cpu_count(), "seconds": time.perf_counter() - started, "layout": LAYOUT,
            "machine": machine, "busy": any(r["report"]["busy"] for r in rows)}
    print(machine_line(machine))
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        plot(rows, out / "transfer.png")
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"wrote {out / 'transfer.json'} and transfer.png in {meta['seconds']:.0f} s")


if __name__ == "__main__":
    main()
