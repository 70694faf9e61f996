"""Cache-pool instances as real subprocesses (``python -m services.cache_pool``).

With ``curve`` (the default) an instance uses the CURVE keys of its work directory, the
ones a ``tests.cluster.Cluster`` in the same directory uses; ``curve=False`` runs plain,
for tests whose own sockets speak to it directly. ``in_process_pool`` runs one in the
test's own event loop instead, for tests that look inside it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.protocol import PoolStats
from tests.cluster import ROOT, free_port, make_keys, stats

BLOCK = 4096
HDR = 32  # SSD block file header (services.cache_pool.disk_format.BLOCK_HEADER)


@asynccontextmanager
async def in_process_pool(transfer_backend: str = "tcp"):
    """A ``CachePool`` of 64 ``BLOCK``-byte DRAM slots on loopback, started in this loop,
    closed after."""
    from services.cache_pool.server import CachePool
    from services.cache_pool.settings import PoolSettings

    settings = PoolSettings(control_addr=f"tcp://127.0.0.1:{free_port()}",
                            events_addr=f"tcp://127.0.0.1:{free_port()}",
                            dram_mib=64 * BLOCK / (1 << 20), block_bytes=BLOCK,
                            log_format="console", transfer_backend=transfer_backend)
    pool = CachePool(settings)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


def blocks(n: int, seed: int = 0, size: int = BLOCK) -> list[tuple[int, bytes, int]]:
    """``n`` random ``(key, data, depth)`` blocks of one chain."""
    rng = random.Random(seed)
    return [(rng.getrandbits(64), rng.randbytes(size), depth) for depth in range(n)]


@dataclass
class PoolProc:
    """One pool instance; ``start`` (again) reuses its addresses and SSD directory."""

    instance: str
    workdir: Path
    dram_blocks: int = 64
    ssd_blocks: int = 0
    block_bytes: int = BLOCK
    extra: list[str] = field(default_factory=list)
    popen: subprocess.Popen | None = None
    curve: bool = True

    def __post_init__(self) -> None:
        self.keys_dir = make_keys(Path(self.workdir)) if self.curve else ""
        self.control = f"tcp://127.0.0.1:{free_port()}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.ssd_dir = self.workdir / f"ssd-{self.instance}"
        self.log = self.workdir / f"pool-{self.instance}.log"
        self.starts = 0

    def args(self, learn_block_bytes: bool = False) -> list[str]:
        args = ["--instance-id", self.instance, "--control-addr", self.control,
                "--events-addr", self.events, "--log-format", "console",
                "--dram-mib", repr(self.dram_blocks * BLOCK / (1 << 20))]
        if not learn_block_bytes:
            args += ["--block-bytes", str(self.block_bytes)]
        if self.ssd_blocks:
            args += ["--ssd-dir", str(self.ssd_dir),
                     "--ssd-mib", repr(self.ssd_blocks * (BLOCK + HDR) / (1 << 20))]
        return args + self.extra

    def command(self, learn_block_bytes: bool = False) -> list[str]:
        return [sys.executable, "-m", "services.cache_pool", *self.args(learn_block_bytes)]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_CURVE_KEYS_DIR": self.keys_dir}

    def start(self, learn_block_bytes: bool = False, timeout_s: float = 20.0) -> PoolProc:
        self.starts += 1
        with self.log.open("a") as log:
            self.popen = subprocess.Popen(self.command(learn_block_bytes), cwd=ROOT,
                                          env=self.env(), stdout=log,
                                          stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"pool {self.instance} exited:\n{self.tail()}")
            try:
                self.stats(0.3)
                return self
            except TimeoutError:
                pass
        raise TimeoutError(f"pool {self.instance} not ready:\n{self.tail()}")

    def stats(self, timeout_s: float = 5.0) -> PoolStats:
        return stats(self.control, timeout_s, server="cache-pool", keys_dir=self.keys_dir)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else 0
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def block_file(self, key: int) -> Path:
        return self.ssd_dir / "blocks" / f"{key >> 56:02x}" / f"{key:016x}.blk"
