"""Shared-memory segments: files in a tmpfs directory (``/dev/shm``) mapped into memory.

Plain files and ``mmap`` rather than ``multiprocessing.shared_memory``: on Python < 3.13
that module registers every segment it opens, even one it only attaches to, with the
resource tracker, which unlinks it when the attaching process exits.

Names: a connection's segments are ``<prefix>-<slot>-<generation>`` with
``prefix = pdkv-<pid>-<12 hex digits>``, so either side can remove everything a
connection ever created by prefix (``unlink_prefix``), including a segment whose name
never reached the peer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"pdkv-[0-9]+-[0-9a-f]{12}(-[0-9]+-[0-9]+)?")


def new_prefix() -> str:
    return f"pdkv-{os.getpid()}-{secrets.token_hex(6)}"


def segment_name(prefix: str, slot: int, generation: int) -> str:
    return f"{prefix}-{slot}-{generation}"


def is_valid_name(name: object) -> bool:
    """True for a prefix or a segment name this module makes (no path separators)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def unlink_prefix(directory: str, prefix: str) -> int:
    """Remove every ``<prefix>-*`` file in ``directory``; how many were removed."""
    if not is_valid_name(prefix):
        raise ValueError(f"not a segment prefix: {prefix!r}")
    removed = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(prefix + "-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


class Segment:
    """One segment mapped into this process.

    ``view`` is a memoryview of the whole mapping (read-only when attached). ``close``
    unmaps it; if someone still holds a view into it, the mapping is released when the
    last such view is, instead.
    """

    def __init__(self, directory: str, name: str, mapping: mmap.mmap) -> None:
        self.directory = directory
        self.name = name
        self.size = len(mapping)
        self._mmap = mapping
        self.view = memoryview(mapping)

    @classmethod
    def create(cls, directory: str, name: str, size: int) -> Segment:
        """A new zero-filled segment of ``size`` bytes; FileExistsError if the name is
        taken, OSError if the directory cannot hold it."""
        if not is_valid_name(name) or size <= 0:
            raise ValueError(f"bad segment {name!r} of {size} bytes")
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(directory, name, mapping)

    @classmethod
    def attach(cls, directory: str, name: str) -> Segment:
        """Map an existing segment read-only.

        FileNotFoundError (with a hint) when it does not exist here, which is what a peer
        on another host, or in another mount namespace, looks like.
        """
        if not is_valid_name(name):
            raise ValueError(f"not a segment name: {name!r}")
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no shared-memory segment {path} (is the sender on this host?)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"shared-memory segment {path} is empty")
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return cls(directory, name, mapping)

    def unlink(self) -> None:
        """Remove the name; the memory lives on while any process maps it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, self.name))

    def close(self) -> None:
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass  # a view of it is still held; the mapping goes when that view does
