"""One backend's receiver or sender, built by its name (``tcp``, ``shm``, ``ucx``).

The one place that maps a backend's name to its classes: ``factory.py`` builds from
here for callers that name a backend, ``multi.py`` for the backends it runs together.
Each backend's module is imported only when one of its kind is built, so that a process
never loads ucxx (and with it numpy) unless it uses ucx.
"""

from __future__ import annotations

from common.transfer.base import ChunkSink, KVSender
from common.transfer.negotiate import PREFERENCE
from common.transfer.table import TransferTable
from common.transfer.table_receiver import TableReceiver


def backend_receiver(
    kind: str,
    host: str,
    port: int,
    *,
    sink: ChunkSink | None = None,
    table: TransferTable | None = None,
) -> TableReceiver:
    """An unstarted ``kind`` receiver feeding ``sink``, or the shared ``table``.

    Raises ValueError for an unknown kind, BackendUnavailable for ``ucx`` when ucxx
    cannot be imported.
    """
    if kind == "tcp":
        from common.transfer.tcp_receiver import TcpReceiver

        return TcpReceiver(host, port, sink=sink, table=table)
    if kind == "shm":
        from common.transfer.shm_receiver import ShmReceiver

        return ShmReceiver(host, port, sink=sink, table=table)
    if kind == "ucx":
        from common.transfer.ucx_receiver import UcxReceiver

        return UcxReceiver(host, port, sink=sink, table=table)
    raise ValueError(f"unknown transfer backend {kind!r}; known: {PREFERENCE}")


def backend_sender(kind: str) -> KVSender:
    """A ``kind`` sender (errors as for ``backend_receiver``)."""
    if kind == "tcp":
        from common.transfer.tcp_sender import TcpSender

        return TcpSender()
    if kind == "shm":
        from common.transfer.shm_sender import ShmSender

        return ShmSender()
    if kind == "ucx":
        from common.transfer.ucx_sender import UcxSender

        return UcxSender()
    raise ValueError(f"unknown transfer backend {kind!r}; known: {PREFERENCE}")
