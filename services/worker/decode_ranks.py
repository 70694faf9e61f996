"""A tensor-parallel decode worker whose every rank receives its own KV heads' slices
(``services/engine/tp_recv.py``): what the decode role asks of its engine for it."""

from __future__ import annotations


def listen_ranks(engine, kinds: list[str], host: str, host_id: str) -> list:
    """Engine thread: each rank's (endpoints, first head, heads) where every rank of this
    TP engine receives its own heads' slices (rank 0's endpoints None: its receiver's);
    [] where they share heads (rank 0 then takes all and scatters)."""
    store = engine.kv_store
    if getattr(store, "receive", None) is None:
        return []
    heads = store.rank_heads()
    others = store.receive.listen(kinds, host, host_id)
    return [(e, start, count) for e, (start, count) in zip([None, *others], heads,
                                                              strict=True)]


def drop_ranks(engine, rid: str, token: bytes | None) -> None:
    """Engine thread: the other ranks stop taking ``rid``'s slices before its blocks can
    be freed."""
    if token is not None:
        engine.kv_store.receive.drop(rid, token)


async def landed(loop, rid: str, token: bytes, lease_s: float) -> tuple[str | None, int]:
    """(Why the other ranks' parts of ``rid``'s KV are not all in, or None once they
    are; the bytes they took)."""
    receive = await loop.run(lambda e: e.kv_store.receive)
    return await receive.landed(rid, token, lease_s)
