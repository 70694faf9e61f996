"""A Migrate whose positions lie is refused before anything is reserved: a stream that
starts at a negative position, or claims more cached tokens than it has."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.protocol import Error, Migrate
from common.sampling_params import SamplingParams
from services.worker.migrate_in import Arrivals


@pytest.mark.parametrize("start, cached", [(-1, 0), (0, -1), (0, 6)])
async def test_lying_positions_are_refused_and_nothing_kept(start, cached):
    role = SimpleNamespace(leaving=False, streams={}, remote={}, aborted=set(), ctx=None,
                           overloaded=lambda: pytest.fail("checked after the positions"))
    arrivals = Arrivals(role)
    rec = Migrate([1, 2, 3], [4, 5], SamplingParams(max_tokens=8), "tcp://127.0.0.1:1",
                  start, "decode-0", cached_tokens=cached)
    reply = await arrivals.offer("r", rec)
    assert isinstance(reply, Error) and reply.code == "bad_request"
    assert not role.streams and not role.remote and not arrivals.pending
