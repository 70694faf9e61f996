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


async def expect_ranks(role, rid: str, stream, token: bytes, slots) -> bool:
    """Event loop: every other rank of ``role``'s engine expects its part of ``rid``'s KV
    into the blocks ``slots`` reserved, before anyone is asked to send. False if an Abort
    ran meanwhile (``stream`` no longer ``rid``'s): it found nothing to drop on those
    ranks then, so the expectation is dropped here, with the engine's copy of ``rid``,
    rather than left until its lease runs out."""
    lease_s, dest = role.ctx.settings.kv_lease_s, slots.block_ids[slots.num_cached_blocks:]
    await role.ctx.loop.run(lambda e: e.kv_store.receive.expect(rid, token, lease_s, dest))
    if role.streams.get(rid) is stream:
        return True
    await role.ctx.loop.run(lambda e: (drop_ranks(e, rid, token), e.abort(rid)))
    return False


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
