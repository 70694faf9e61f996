"""A data-plane sink for transfer tests: it records every chunk a receiver hands over."""

from __future__ import annotations


class Sink:
    """Records every chunk the receiver hands over; optionally raises for one request."""

    def __init__(self, raise_for: str | None = None) -> None:
        self.chunks: list[tuple[str, int, list[int], bytes]] = []
        self.raise_for = raise_for

    def __call__(self, request_id, layer, block_ids, payload) -> None:
        if request_id == self.raise_for:
            raise RuntimeError("destination blocks were freed")
        self.chunks.append((request_id, layer, list(block_ids), bytes(payload)))

    def of(self, request_id: str) -> list[tuple[str, int, list[int], bytes]]:
        return [c for c in self.chunks if c[0] == request_id]
