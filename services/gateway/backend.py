"""What the gateway's front-ends need from whatever generates tokens.

The HTTP and ZeroMQ front-ends speak to a ``GenerationBackend``: in production the
routed conductor/decode-worker client, in tests a fake. A backend sees token ids only;
text (templates, detokenization, stop strings) stays in the gateway.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from common.protocol import Tokens

SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "stop_token_ids",
                 "ignore_eos", "logprobs", "min_tokens")
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as a backend sees it.

    ``sampling`` holds exactly the keys in ``SAMPLING_KEYS`` (the fields of the engine's
    ``SamplingParams``), already validated by the gateway. ``cache_salt`` separates
    prefix-cache entries of different tenants. ``slo_ttft_ms`` / ``slo_tbt_ms`` are the
    request's latency targets (None: the cluster's defaults). ``timing``: the last event
    carries the request's ``Timing``; ``trace``: the client's traceparent, if valid.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None = None
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    timing: bool = False
    trace: str | None = None


class BackendOverloaded(Exception):
    """Admission refused for now (SLO-aware rejection); retry after ``retry_after_s``."""

    def __init__(self, message: str = "the server is overloaded",
                 retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(Exception):
    """No worker can take the request (none registered, all dead)."""


class GenerationBackend(ABC):
    """Generates tokens for requests; many requests run concurrently.

    Contract:

    - ``generate`` is an async generator (``async def`` with ``yield``). It yields
      ``Tokens`` (the record workers stream) in position order, without gaps:
      ``position`` is the index of ``token_ids[0]`` in the output, and the last one has
      ``finished=True`` and a ``finish_reason`` in ``FINISH_REASONS`` (with ``"error"``,
      ``error`` says what went wrong). ``prompt_tokens`` / ``cached_tokens`` may be 0
      until known; ``logprobs`` has one TokenLogprob per token when requested. Before
      its first event it may raise ``ValueError`` (the request cannot be served as
      asked; HTTP 400), ``BackendOverloaded`` (429) or
      ``BackendUnavailable`` (503). A failure after the first event is reported as a
      finished event with ``finish_reason="error"``, not raised.
    - Closing the generator early (``aclose``) means the consumer lost interest; the
      gateway also calls ``abort``. ``abort`` of an unknown or finished request is a
      no-op, and it never raises for that reason.
    - ``ready`` is True when a request sent now could be served.
    """

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[Tokens]:
        """Start ``request``; iterate the result for its tokens."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` and free what it holds."""

    @abstractmethod
    async def ready(self) -> bool:
        """Whether the backend can take requests now."""

    def refused(self) -> list[dict[str, str]]:
        """Workers of the model the cluster refused lately, as of the last ``ready``:
        ``{"worker_id", "reason"}`` each; for ``/health``."""
        return []
