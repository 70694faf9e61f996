"""The data plane: bulk KV bytes between processes, never through the control sockets.

See ``base.py`` for the interface and its contract, ``tcp.py`` for the first backend.
"""

from common.transfer.base import (
    ChunkSink,
    KVReceiver,
    KVSender,
    Transfer,
    TransferError,
    TransferState,
    make_receiver,
    make_sender,
)

__all__ = [
    "ChunkSink",
    "KVReceiver",
    "KVSender",
    "Transfer",
    "TransferError",
    "TransferState",
    "make_receiver",
    "make_sender",
]
