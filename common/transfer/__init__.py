"""The data plane: bulk KV bytes between processes, never through the control sockets.

See ``base.py`` for the interface and its contract; the backends are ``tcp.py``,
``shm.py`` (with ``shm_sender.py``) and ``ucx.py``; ``negotiate.py`` picks one per peer
pair and ``multi.py`` runs several at once.
"""

from common.transfer.base import (
    BACKENDS,
    ChunkSink,
    KVReceiver,
    KVSender,
    Transfer,
    TransferError,
    TransferState,
    make_receiver,
    make_sender,
)
from common.transfer.multi import MultiReceiver, MultiSender
from common.transfer.negotiate import (
    BackendUnavailable,
    Choice,
    available_backends,
    choose,
    make_advert,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "ChunkSink",
    "Choice",
    "KVReceiver",
    "KVSender",
    "MultiReceiver",
    "MultiSender",
    "Transfer",
    "TransferError",
    "TransferState",
    "available_backends",
    "choose",
    "make_advert",
    "make_receiver",
    "make_sender",
]
