"""Tokens of one request in position order: prefill sends position 0, decode the rest,
over two sockets, so they may arrive out of order or (after a failover) overlap."""

from __future__ import annotations

from common.protocol import Tokens


def release(pending: dict[int, Tokens], generated: list[int]):
    """Yield the events that continue the stream at ``len(generated)``, in order."""
    while True:
        nxt = len(generated)
        stale = [p for p in pending if p < nxt]
        for p in stale:  # overlapping or repeated positions: keep only the new tail
            t = pending.pop(p)
            if p + len(t.token_ids) > nxt or (t.finished and p + len(t.token_ids) >= nxt):
                pending[nxt] = tail(t, nxt - p)
        t = pending.pop(nxt, None)
        if t is None:
            return
        generated.extend(t.token_ids)
        yield t  # pending is keyed by position: t.position == nxt
        if t.finished:
            return


def tail(t: Tokens, skip: int) -> Tokens:
    return Tokens(position=t.position + skip, token_ids=list(t.token_ids[skip:]),
                  finished=t.finished, finish_reason=t.finish_reason,
                  prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
                  source=t.source, error=t.error, logprobs=list(t.logprobs[skip:]))
