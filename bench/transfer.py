"""KV transfer throughput of each backend between two processes, against the physical
limit it is held to, measured in the same run:  python bench/transfer.py [--sizes 1,16,256]

Payloads: a request's whole KV in the default model's layout (30 layers, 16-token blocks,
3 KV heads x 64 dims, fp32: 46,080 bytes a token), rounded up to whole blocks, sent as one
chunk per layer for non-contiguous block ids, then ``finish``, as the prefill worker does.
The receiving sink does nothing (the worker's copy into its KV blocks is the same whatever
the backend). Figures are medians over repetitions after a warm-up, backend and limit
alternating; a repetition ends when the receiving process says (a stdout line) it has all.

Limits: tcp, blocking ``sendall`` of each layer / ``recv_into`` one buffer (goal 0.9x);
shm, ``memcpy`` of each layer into a pre-faulted segment the receiver maps (goal 0.8x);
ucx, the whole payload in one ucxx send (goal 0.9x). Writes bench/results/transfer.*
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import statistics
import sys
import time
from pathlib import Path

import structlog

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUT = {"layers": 30, "block_tokens": 16, "kv_heads": 3, "head_dim": 64, "dtype": "float32"}
LAYERS, BLOCK_LAYER_BYTES = 30, 2 * 16 * 3 * 64 * 4  # K and V of one block in one layer
GOALS, MIB = {"tcp": 0.9, "shm": 0.8, "ucx": 0.9}, 1 << 20


async def serve_backend(kind: str, count: str) -> None:
    from common.transfer import make_receiver

    rx = make_receiver(kind, sink=lambda *args: None)
    await rx.start()
    # One token a transfer, drawn here and told to the sender, as a decode worker does.
    tokens = [secrets.token_bytes(16) for _ in range(int(count))]
    transfers = [rx.expect(f"r{i}", lease_s=600, token=t) for i, t in enumerate(tokens)]
    print(f"addr {rx.address}", flush=True)
    print("tokens " + ",".join(t.hex() for t in tokens), flush=True)
    for i, transfer in enumerate(transfers):
        await transfer.wait()
        print(f"done r{i}", flush=True)
    await rx.close()


def serve_raw_tcp() -> None:
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    listener = socket.socket()
    tune_socket(listener, SOCKET_BUFFER_BYTES)  # before listen, as the tcp backend does
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"addr {listener.getsockname()[1]}", flush=True)
    conn, buffer = listener.accept()[0], memoryview(bytearray(64 * MIB))
    while total := int.from_bytes(conn.recv(8, socket.MSG_WAITALL) or b"", "little"):
        while total:
            total -= conn.recv_into(buffer[: min(total, len(buffer))])
        print("done", flush=True)


def serve_raw_shm(name: str) -> None:
    from common.transfer.shm_segment import SHM_DIR, Segment

    segment = Segment.attach(SHM_DIR, name)
    print("addr mapped", flush=True)
    for _line in sys.stdin:  # one line a repetition: the bytes are in place
        print("done", flush=True)
    segment.close()


async def serve_raw_ucx(max_bytes: str) -> None:
    import ucxx

    buffer, finished = bytearray(int(max_bytes)), asyncio.Event()

    async def handler(ep) -> None:
        try:
            while True:
                await ep.recv(buffer)
                print("done", flush=True)
        except Exception:
            finished.set()

    listener = ucxx.create_listener(handler)
    print(f"addr {listener.port}", flush=True)
    await finished.wait()
    del listener  # stops listening


class Peer:
    """A receiving process: its first line is its address, then one line a repetition."""

    async def start(self, *args: str) -> str:
        pipe = asyncio.subprocess.PIPE
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve", *args, cwd=ROOT, stdin=pipe, stdout=pipe)
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
async def backend(peer: Peer, kind: str, chunks: list[memoryview], blocks: list[int], reps: int):
    from common.transfer import make_sender

    sender, address = make_sender(kind), await peer.start("backend", kind, str(reps))
    tokens = [bytes.fromhex(t) for t in (await peer.line()).removeprefix("tokens ").split(",")]

    async def one(rep: int) -> None:
        for layer, chunk in enumerate(chunks):
            await sender.send(address, f"r{rep}", layer, blocks, chunk, token=tokens[rep])
        await sender.finish(address, f"r{rep}", len(chunks), token=tokens[rep])
        if await peer.line() != f"done r{rep}":
            raise RuntimeError(f"{kind} transfer r{rep} did not complete")

    try:
        yield one
    finally:
        await sender.close()


@contextlib.asynccontextmanager
async def tcp_limit(peer: Peer, chunks: list[memoryview], payload: memoryview):
    from common.transfer.tcp import SOCKET_BUFFER_BYTES, tune_socket

    sock = socket.socket()
    tune_socket(sock, SOCKET_BUFFER_BYTES)  # before connect, as the tcp backend does
    sock.connect(("127.0.0.1", int(await peer.start("raw", "tcp"))))

    async def one(rep: int) -> None:
        sock.sendall(payload.nbytes.to_bytes(8, "little"))
        for chunk in chunks:
            sock.sendall(chunk)
        await peer.line()

    with sock:
        yield one


@contextlib.asynccontextmanager
async def shm_limit(peer: Peer, chunks: list[memoryview], payload: memoryview):
    from common.transfer.shm_segment import SHM_DIR, Segment, new_prefix

    segment = Segment.create(SHM_DIR, new_prefix(), payload.nbytes)
    segment.view[:] = payload  # every page faulted in once, as the backend's ring is

    async def one(rep: int) -> None:
        offset = 0
        for chunk in chunks:
            segment.view[offset : offset + chunk.nbytes] = chunk
            offset += chunk.nbytes
        peer.proc.stdin.write(b"go\n")
        await peer.line()

    try:
        await peer.start("raw", "shm", segment.name)
        yield one
    finally:
        segment.unlink()
        segment.close()


@contextlib.asynccontextmanager
async def ucx_limit(peer: Peer, chunks: list[memoryview], payload: memoryview):
    import ucxx

    port = await peer.start("raw", "ucx", str(payload.nbytes))
    ep = await ucxx.create_endpoint("127.0.0.1", int(port))

    async def one(rep: int) -> None:
        await ep.send(payload)
        await peer.line()

    try:
        yield one
    finally:
        await ep.close()


LIMITS = {"tcp": tcp_limit, "shm": shm_limit, "ucx": ucx_limit}


async def measure_pair(kind: str, chunks, payload, blocks, reps: int) -> tuple[float, float]:
    """Median seconds of (backend, limit), alternating so that both see the same machine."""
    peers = Peer(), Peer()
    try:
        async with (
            backend(peers[0], kind, chunks, blocks, reps) as ours,
            LIMITS[kind](peers[1], chunks, payload) as limit,
        ):
            seconds: tuple[list[float], list[float]] = ([], [])
            for rep in range(reps):
                for one, spent in ((ours, seconds[0]), (limit, seconds[1])):
                    start = time.perf_counter()
                    await one(rep)
                    spent.append(time.perf_counter() - start)
        return statistics.median(seconds[0][1:]), statistics.median(seconds[1][1:])
    finally:
        for peer in peers:
            await peer.stop()


async def measure(kinds: list[str], sizes: list[int]) -> list[dict]:
    rows = []
    for mib in sizes:
        blocks = list(range(1, 3 * math.ceil(mib * MIB / (LAYERS * BLOCK_LAYER_BYTES)), 3))
        layer_bytes = len(blocks) * BLOCK_LAYER_BYTES
        reps = 31 if mib <= 1 else 11 if mib <= 16 else 4  # each after a warm-up
        repeats = math.ceil(LAYERS * layer_bytes / MIB)
        payload = memoryview(os.urandom(MIB) * repeats)[: LAYERS * layer_bytes]
        chunks = [payload[i * layer_bytes : (i + 1) * layer_bytes] for i in range(LAYERS)]
        for kind in kinds:
            ours, limit = await measure_pair(kind, chunks, payload, blocks, reps)
            row = {"backend": kind, "size_mib": mib, "bytes": payload.nbytes,
                   "blocks": len(blocks), "backend_gbps": payload.nbytes / ours / 1e9,
                   "limit_gbps": payload.nbytes / limit / 1e9, "ratio": limit / ours,
                   "goal": GOALS[kind]}
            rows.append(row)
            print(f"{kind:>4} {mib:>4} MiB ({len(blocks):>3} blocks) "
                  f"{row['backend_gbps']:7.2f} GB/s  limit {row['limit_gbps']:7.2f} GB/s  "
                  f"{row['ratio']:4.2f}x  goal {row['goal']}x "
                  f"{'met' if row['ratio'] >= row['goal'] else 'MISSED'}", flush=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,256", help="payload sizes in MiB")
    parser.add_argument("--backends", default="", help="default: every available one")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        structlog.configure(  # stdout carries this process's lines to the measuring one
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        mode, kind, *rest = args.serve
        if mode == "backend" or kind == "ucx":
            serving = serve_backend(kind, *rest) if mode == "backend" else serve_raw_ucx(*rest)
            return asyncio.run(serving)
        return serve_raw_tcp() if kind == "tcp" else serve_raw_shm(*rest)
    from common.transfer import BackendUnavailable, available_backends
    from common.transfer.ucx import load_ucxx

    kinds = args.backends.split(",") if args.backends else list(available_backends())
    if "ucx" in kinds:
        try:
            load_ucxx()
        except BackendUnavailable as exc:  # an optional package missing is no failure here
            print(f"skipping ucx: {exc}")
            kinds.remove("ucx")
    started = time.perf_counter()
    rows = asyncio.run(measure(kinds, [int(s) for s in args.sizes.split(",")]))
    meta = {"cpus": os.cpu_count(), "seconds": time.perf_counter() - started, "layout": LAYOUT}
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        plot(rows, out / "transfer.png")
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(f"wrote {out / 'transfer.json'} and transfer.png in {meta['seconds']:.0f} s")


if __name__ == "__main__":
    main()
