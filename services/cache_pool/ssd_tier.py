"""The SSD tier of the cache pool: a directory of block files and an index log."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import structlog

from common.pool.keys import Buffer, check_block
from services.cache_pool import disk_format as fmt
from services.cache_pool.block import check_empty_policy
from services.cache_pool.eviction import EvictionPolicy

log = structlog.get_logger(__name__)


class Recovery(NamedTuple):
    """What ``SsdTier`` found on start."""

    loaded: int            # blocks served from the previous run
    dropped: int           # indexed blocks whose file was missing or the wrong size
    orphans_removed: int   # block or temp files the index did not name
    index_discarded: str   # why the index was thrown away ("" when it was not)


class SsdTier:
    """One file per block under ``directory/blocks``, and ``directory/index.log``.

    One file per block rather than segment files: KV blocks are hundreds of KiB to a few
    MiB, so a file each costs little, deletion is an ``unlink`` that frees the space at
    once, and there is no segment garbage collection or compaction of block data.

    Capacity counts each block file whole (32-byte header + payload); the index log is
    not counted. The index is an append-only log (see ``disk_format``), flushed after
    every operation and rewritten atomically (temp file, fsync, rename, fsync of the
    directory) on start and when stale records outnumber live ones. Block files are not
    fsynced: a block whose bytes did not reach the disk fails its checksum and is dropped.

    ``get`` verifies the block's checksum; a corrupt, truncated or missing file is a miss
    and the block is dropped (file and index entry), never served. On start, the log is
    replayed and the policy rebuilt in the recorded recency order; a torn last record is
    ignored, a log that cannot be replayed is discarded with a warning (the tier starts
    empty), and files the index does not name are deleted.
    """

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int,
                 policy: EvictionPolicy) -> None:
        if capacity_bytes <= fmt.BLOCK_HEADER.size:
            raise ValueError(f"capacity_bytes must exceed {fmt.BLOCK_HEADER.size}, "
                             f"got {capacity_bytes}")
        check_empty_policy(policy)
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.evictions = 0
        self.corrupt_dropped = 0
        self._entries: OrderedDict[int, fmt.IndexEntry] = OrderedDict()  # LRU first
        self._used = 0
        self._records = 0
        (self.directory / "blocks").mkdir(parents=True, exist_ok=True)
        self._index_path = self.directory / "index.log"
        self._log = None
        self.recovery = self._recover()

    # -- public API ---------------------------------------------------------------------

    def put(self, key: int, data: Buffer, depth: int = 0) -> list[int]:
        """Store the block; returns the keys evicted to make room. Raises ValueError if
        the block cannot fit at all, OSError if writing failed (nothing evicted then)."""
        data = check_block(key, data, depth)
        size = fmt.BLOCK_HEADER.size + len(data)
        if size > self.capacity_bytes:
            raise ValueError(f"block of {size} bytes exceeds capacity {self.capacity_bytes}")
        if key in self._entries:
            self._touch(key)
            return []
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(fmt.encode_block(key, data))
                f.write(data)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        evicted = []
        while self._used + size > self.capacity_bytes:
            victim = self.policy.victim()
            self._drop(victim)
            evicted.append(victim)
            self.evictions += 1
        os.replace(tmp, path)
        self._entries[key] = fmt.IndexEntry(len(data), depth)
        self._used += size
        self.policy.on_insert(key, depth)
        self._append(fmt.encode_record(fmt.OP_PUT, key, depth, len(data)))
        return evicted

    def get(self, key: int) -> bytes | None:
        """The block's bytes, checksum verified, and a use; None if absent or corrupt."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        try:
            data = fmt.decode_block(key, self._path(key).read_bytes(), entry.length)
        except (OSError, fmt.CorruptBlock) as e:
            log.warning("ssd_block_dropped", key=f"{key:016x}", reason=str(e))
            self._drop(key)
            self.corrupt_dropped += 1
            return None
        self._touch(key)
        return data

    def contains(self, key: int) -> bool:
        return key in self._entries

    __contains__ = contains

    def depth(self, key: int) -> int:
        return self._entries[key].depth

    def length(self, key: int) -> int:
        """The block's payload length in bytes (header not counted); KeyError if absent."""
        return self._entries[key].length

    def remove(self, key: int) -> bool:
        """Drop ``key`` and its file; False if it was not held."""
        if key not in self._entries:
            return False
        self._drop(key)
        return True

    def keys(self) -> list[int]:
        """Held keys, least recently used first."""
        return list(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def sync(self) -> None:
        """Make every index record so far durable."""
        self._log.flush()
        os.fsync(self._log.fileno())

    def close(self) -> None:
        if self._log is not None and not self._log.closed:
            self.sync()
            self._log.close()

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------

    def _path(self, key: int) -> Path:
        return self.directory / "blocks" / f"{key >> 56:02x}" / f"{key:016x}.blk"

    def _touch(self, key: int) -> None:
        self._entries.move_to_end(key)
        self.policy.on_access(key)
        self._append(fmt.encode_record(fmt.OP_TOUCH, key))

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._used -= fmt.BLOCK_HEADER.size + entry.length
        self.policy.on_remove(key)
        self._path(key).unlink(missing_ok=True)
        self._append(fmt.encode_record(fmt.OP_DELETE, key))

    def _append(self, record: bytes) -> None:
        self._log.write(record)
        self._log.flush()
        self._records += 1
        if self._records > 2 * len(self._entries) + 1024:
            self._rewrite_index()

    def _rewrite_index(self) -> None:
        if self._log is not None:
            self._log.close()
        tmp = self._index_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(fmt.INDEX_MAGIC)
            for key, entry in self._entries.items():
                f.write(fmt.encode_record(fmt.OP_PUT, key, entry.depth, entry.length))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._index_path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._records = len(self._entries)
        self._log = open(self._index_path, "ab")  # noqa: SIM115 - held open for appends

    def _recover(self) -> Recovery:
        discarded, dropped = "", 0
        try:
            replay = fmt.replay_index(self._index_path.read_bytes())
        except FileNotFoundError:
            replay = fmt.Replay(OrderedDict(), 0, False)
        except (OSError, fmt.CorruptIndex) as e:
            discarded = str(e) or type(e).__name__
            log.warning("ssd_index_discarded", directory=str(self.directory), reason=discarded)
            replay = fmt.Replay(OrderedDict(), 0, False)
        if replay.torn_tail:
            log.warning("ssd_index_torn_tail", directory=str(self.directory))
        for key, entry in replay.entries.items():
            try:
                ok = self._path(key).stat().st_size == fmt.BLOCK_HEADER.size + entry.length
            except OSError:
                ok = False
            if not ok:
                dropped += 1
                continue
            self._entries[key] = entry
            self._used += fmt.BLOCK_HEADER.size + entry.length
            self.policy.on_insert(key, entry.depth)
        orphans = self._remove_orphans()
        self._rewrite_index()
        while self._used > self.capacity_bytes:  # the capacity may have shrunk
            self._drop(self.policy.victim())
            self.evictions += 1
        if dropped or orphans:
            log.warning("ssd_recovery", dropped=dropped, orphans_removed=orphans)
        return Recovery(len(self._entries), dropped, orphans, discarded)

    def _remove_orphans(self) -> int:
        removed = 0
        for sub in (self.directory / "blocks").iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                try:
                    key = int(path.stem, 16) if path.suffix == ".blk" else None
                except ValueError:
                    key = None
                if key is None or key not in self._entries or path != self._path(key):
                    path.unlink(missing_ok=True)
                    removed += 1
        return removed
