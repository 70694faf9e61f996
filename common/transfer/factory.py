"""Receivers and senders by the name a setting gives: one backend, or ``auto``.

Kept apart from the interface (``base.py``), which knows no backend, and from
``backends.py``, which builds single backends for this module and for ``multi.py``
alike: ``auto`` is built from ``multi.py``, so nothing here is imported back by it.
"""

from __future__ import annotations

from common.transfer.backends import backend_receiver, backend_sender
from common.transfer.base import ChunkSink, KVReceiver, KVSender
from common.transfer.multi import MultiReceiver, MultiSender

BACKENDS = ("tcp", "shm", "ucx", "auto")
"""Kinds ``make_receiver`` and ``make_sender`` build: one backend each (``tcp``, ``shm``,
``ucx``), or ``auto``: every backend available here at once, with the sender picking per
peer (``multi.py``, ``negotiate.py``)."""


def make_receiver(
    kind: str = "tcp", *, host: str = "127.0.0.1", port: int = 0, sink: ChunkSink
) -> KVReceiver:
    """Build an unstarted receiver of backend ``kind``; port 0 picks a free port.

    For ``auto``, ``port`` is the tcp backend's and the others pick free ports. Raises
    ValueError for an unknown kind, BackendUnavailable (a TransferError and an
    ImportError) for ``ucx`` when ucxx cannot be imported.
    """
    if kind not in BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r}; known: {BACKENDS}")
    if kind == "auto":
        return MultiReceiver(host=host, port=port, sink=sink)
    return backend_receiver(kind, host, port, sink=sink)


def make_sender(kind: str = "tcp") -> KVSender:
    """Build a sender of backend ``kind`` (errors as for ``make_receiver``)."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r}; known: {BACKENDS}")
    if kind == "auto":
        return MultiSender()
    return backend_sender(kind)
