"""An Abort that overtakes its Generate still cancels it."""

import time

from services.worker.tombstones import Tombstones


def test_tombstone_is_kept_for_its_ttl_then_forgotten(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    t = Tombstones(ttl_s=5.0)
    t.add("a")
    now[0] += 4.9
    assert "a" in t and len(t) == 1
    now[0] += 0.2
    assert "a" not in t and len(t) == 0


def test_tombstones_are_bounded_oldest_first():
    t = Tombstones(ttl_s=60.0, max_size=3)
    for rid in "abcd":
        t.add(rid)
    assert [rid in t for rid in "abcd"] == [False, True, True, True]
    t.discard("c")
    assert "c" not in t and len(t) == 2
