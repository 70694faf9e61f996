"""Which backend a sender uses to reach a receiver.

Each receiving peer advertises where it listens as a ``KVAdvert`` record
(``common.records``), which travels over the control plane as it is::

    KVAdvert(host_id="gpu-node-7", endpoints={"shm": "shm://127.0.0.1:41001",
                                              "ucx": "ucx://10.0.0.7:41002",
                                              "tcp": "tcp://10.0.0.7:41003"})

``choose`` picks, in this order, the first backend that both sides have: ``shm`` (only
when both peers report the same host id), ``ucx``, ``tcp``. A forced backend is used or
refused, never silently replaced. Host ids are compared as strings; give each host a
stable, unique one (the default is the host name).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import structlog

from common.records import KVAdvert
from common.transfer.base import TransferError
from common.transfer.shm_segment import SHM_DIR

log = structlog.get_logger("pdserve.transfer")

PREFERENCE = ("shm", "ucx", "tcp")
"""Every backend kind, best first."""


class BackendUnavailable(TransferError, ImportError):
    """A backend cannot run in this process (a package or facility is missing).

    ``kind`` is the backend; ``name`` (as for ImportError) the missing package, if any.
    """

    def __init__(self, kind: str, reason: str, package: str | None = None) -> None:
        TransferError.__init__(self, f"{kind} transfer backend unavailable: {reason}")
        self.kind = kind
        self.name = package


class Choice(NamedTuple):
    kind: str
    address: str


def scheme_of(address: str) -> str:
    """The backend kind an address names (``"shm://..."`` -> ``"shm"``); ValueError if
    it names none."""
    kind, sep, _ = address.partition("://") if isinstance(address, str) else ("", "", "")
    if not sep or kind not in PREFERENCE:
        raise ValueError(f"not a transfer address (one of {PREFERENCE}): {address!r}")
    return kind


def default_host_id() -> str:
    return socket.gethostname()


def available_backends(shm_dir: str = SHM_DIR) -> tuple[str, ...]:
    """The backends this process can offer, best first, without importing any of them.

    ``ucx`` is listed when the ``ucxx`` package is installed; whether it really loads is
    known only when a ucx receiver or sender is built (BackendUnavailable otherwise).
    """
    kinds = []
    if os.path.isdir(shm_dir) and os.access(shm_dir, os.W_OK | os.X_OK):
        kinds.append("shm")
    try:
        if importlib.util.find_spec("ucxx") is not None:
            kinds.append("ucx")
    except (ImportError, ValueError):  # a broken or deliberately hidden install
        pass
    kinds.append("tcp")
    return tuple(kinds)


def make_advert(host_id: str, endpoints: Mapping[str, str]) -> KVAdvert:
    """The advert of a peer; ValueError if an endpoint's kind and address disagree."""
    advert = KVAdvert(host_id=host_id, endpoints=dict(endpoints))
    check_advert(advert)
    return advert


def check_advert(advert: object) -> tuple[str, dict[str, str]]:
    """``(host_id, endpoints)`` of a received advert; ValueError if it is not a
    ``KVAdvert`` or is malformed (the codec checks field types, not what they say)."""
    if not isinstance(advert, KVAdvert):
        raise ValueError(f"an advert is a KVAdvert record, got {type(advert).__name__}")
    host_id, endpoints = advert.host_id, advert.endpoints
    if not isinstance(host_id, str) or not host_id:
        raise ValueError(f"advert host_id must be a non-empty string, got {host_id!r}")
    if not isinstance(endpoints, Mapping) or not endpoints:
        raise ValueError(f"advert endpoints must be a non-empty map, got {endpoints!r}")
    for kind, address in endpoints.items():
        if kind not in PREFERENCE or scheme_of(address) != kind:
            raise ValueError(f"advert endpoint {kind!r}: {address!r} is not a {kind} address")
    return host_id, dict(endpoints)


def choose(
    local_host_id: str,
    local_backends: Iterable[str],
    peer_advert: KVAdvert,
    forced: str | None = None,
) -> Choice:
    """The backend and address to send to the advertising peer with.

    Raises TransferError when ``forced`` is one the peer does not offer, one this side
    lacks, or ``shm`` across hosts, and when the two sides share no backend;
    ValueError for a malformed advert or an unknown ``forced`` kind.
    """
    peer_host, endpoints = check_advert(peer_advert)
    local = set(local_backends)
    same_host = peer_host == local_host_id
    if forced is not None:
        if forced not in PREFERENCE:
            raise ValueError(f"unknown transfer backend {forced!r}; known: {PREFERENCE}")
        if forced not in endpoints:
            raise TransferError(
                f"backend {forced!r} is forced but the peer on {peer_host!r} "
                f"offers only {sorted(endpoints)}"
            )
        if forced not in local:
            raise TransferError(
                f"backend {forced!r} is forced but is not available here "
                f"(this side has {sorted(local)})"
            )
        if forced == "shm" and not same_host:
            raise TransferError(
                f"backend 'shm' is forced but the peer is on host "
                f"{peer_host!r}, not {local_host_id!r}"
            )
        candidates = [forced]
    else:
        candidates = [
            k for k in PREFERENCE if k in local and k in endpoints and (k != "shm" or same_host)
        ]
        if not candidates:
            raise TransferError(
                f"no transfer backend in common with {peer_host!r}: "
                f"it offers {sorted(endpoints)}, this side has {sorted(local)}"
            )
    choice = Choice(candidates[0], endpoints[candidates[0]])
    log.info(
        "kv_transfer.backend_chosen",
        kind=choice.kind,
        address=choice.address,
        peer_host=peer_host,
        same_host=same_host,
        forced=forced,
    )
    return choice
