"""The data plane: bulk KV bytes between processes, never through the control sockets.

    base.py            the interface and its contract (KVSender, KVReceiver, Transfer,
                       TransferState, TransferError, ChunkSink); knows no backend
    factory.py         make_receiver / make_sender by the name a setting gives
    backends.py        one backend's receiver or sender by its name
    multi.py           several backends at once (MultiReceiver, MultiSender)
    negotiate.py       adverts, and which backend a sender uses for a receiver
    table.py           receiver side shared by every backend: the live transfers
                       (TransferTable) and the receiver lifecycle (TableReceiver)
    connections.py     sender side shared by every backend: per-address connections,
                       verdicts and resends (ConnectionSender, StreamSender)
    wire.py            message framing and verdicts; control.py: msgpack control frames
    <kind>.py          a backend's protocol and settings (tcp, shm, ucx), with
    <kind>_sender.py   its sender and
    <kind>_receiver.py its receiver; frame_reader.py reads a tcp connection,
                       shm_segment.py holds shm's segments

Addresses are parsed and written by ``common/address.py``. Imports among these modules
form no cycle (``tests/test_transfer_imports.py``).
"""

from common.transfer.base import (
    ChunkSink,
    KVReceiver,
    KVSender,
    LandingSink,
    Transfer,
    TransferError,
    TransferState,
)
from common.transfer.factory import BACKENDS, make_receiver, make_sender
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
    "LandingSink",
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
