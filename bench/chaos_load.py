"""The steady load of ``bench/chaos.py``: requests at their arrival times, each one's
outcome checked as it streams.

Over the ZeroMQ client port a request's output is its token ids and every chunk's
``position`` is checked: a chunk starting past the next expected position lost tokens,
one starting before it repeats them. Over HTTP SSE the output is the text; a completion
with fewer tokens than ``max_tokens`` (``ignore_eos`` is set, so it must have them all)
lost the rest. A request that fails is counted by reason: a clean failure is an error the
gateway answered with (an error chunk, an HTTP status, an SSE error event) other than its
request timeout; a timeout (the cluster lost the request) or a dropped connection is not.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import aiohttp

from bench.serve import error_message, sse_data
from common.client import AsyncClient, GenerationError
from tests.cluster import Cluster

# Sent along as the request's timeout: a request lost inside the cluster ends by it.
REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Req:
    """One request; ``source`` is the index of the request whose reference output it must
    match (itself, or the original that an overload burst repeats)."""

    index: int
    at_s: float
    prompt: list[int]
    max_tokens: int
    seed: int | None  # None: greedy
    http: bool
    source: int = -1

    def __post_init__(self) -> None:
        if self.source < 0:
            object.__setattr__(self, "source", self.index)

    def sampling(self) -> dict:
        if self.seed is None:
            return {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        return {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 1.0,
                "seed": self.seed}


@dataclass(frozen=True, slots=True)
class Outcome:
    req: Req
    start_s: float
    end_s: float
    output: list[int] | str
    error: str | None = None  # the reason, with ids and numbers blanked out
    clean: bool = True
    lost: int = 0
    repeated: int = 0


def reason(text: str) -> str:
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", text)[:90]


async def _zmq(client: AsyncClient, req: Req) -> tuple[list[int], int, int, str | None, bool]:
    ids: list[int] = []
    nxt = lost = repeated = 0
    try:
        async for c in client.stream(prompt_token_ids=req.prompt,
                                     request_id=f"chaos-{req.index}-{uuid.uuid4().hex[:8]}",
                                     **req.sampling()):
            if c.token_ids:
                if c.position > nxt:
                    lost += c.position - nxt
                elif c.position < nxt:
                    repeated += min(nxt - c.position, len(c.token_ids))
                ids.extend(c.token_ids)
                nxt = max(nxt, c.position + len(c.token_ids))
    except GenerationError as e:  # the gateway's own timeout: the cluster lost it
        return ids, lost, repeated, reason(str(e)), e.code != "timeout"
    except TimeoutError:
        return ids, lost, repeated, "no answer within the client timeout", False
    lost += max(0, req.max_tokens - nxt)
    return ids, lost, repeated, None, True


async def _http(session: aiohttp.ClientSession, url: str, model: str,
                req: Req) -> tuple[str, int, int, str | None, bool]:
    body = {"model": model, "prompt": req.prompt, "stream": True,
            "stream_options": {"include_usage": True}, **req.sampling()}
    text: list[str] = []
    usage: dict = {}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status >= 300:
                return "", 0, 0, reason(f"HTTP {resp.status}: "
                                        f"{error_message(await resp.text())}"), \
                    resp.status != 504
            async for data, _ in sse_data(resp.content):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return "".join(text), 0, 0, reason(
                        "SSE error: " + error_message(data)), "request_timeout" not in data
                usage = chunk.get("usage") or usage
                text += [c.get("text") or "" for c in chunk.get("choices") or ()]
    # Whatever went wrong belongs to this request; the load goes on.
    except Exception as e:  # noqa: BLE001
        return "".join(text), 0, 0, reason(f"{type(e).__name__}: {e}"), False
    if not usage:
        return "".join(text), 0, 0, "stream ended without usage", False
    return "".join(text), max(0, req.max_tokens - usage["completion_tokens"]), 0, None, True


Faults = Callable[[float, Callable[[int, float], None]], Awaitable[None]]


async def run_load(cluster: Cluster, reqs: list[Req], faults: Faults | None) -> list[Outcome]:
    """Send ``reqs`` at their times (from now); ``faults(t0, overload)`` runs alongside,
    where ``overload(n, over_s)``, callable from any thread, repeats ``n`` random earlier
    requests spread over the next ``over_s`` seconds."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    url = cluster.base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with AsyncClient(cluster.zmq_addr, timeout_s=REQUEST_TIMEOUT_S) as client, \
            aiohttp.ClientSession(timeout=timeout) as session:

        async def one(req: Req) -> None:
            await asyncio.sleep(max(0.0, t0 + req.at_s - time.monotonic()))
            start = time.monotonic() - t0
            if req.http:
                out, lost, rep, err, clean = await _http(session, url, cluster.model, req)
            else:
                out, lost, rep, err, clean = await _zmq(client, req)
            outcomes.append(Outcome(req, start, time.monotonic() - t0, out, err, clean,
                                    lost, rep))

        def submit(batch: list[Req]) -> None:
            tasks.extend(asyncio.ensure_future(one(r)) for r in batch)

        def overload(n: int, over_s: float) -> None:
            now = time.monotonic() - t0
            rng = random.Random(len(tasks))
            pool = [r for r in reqs if r.at_s <= now] or reqs
            first = len(reqs) + len(tasks)
            batch = [replace(rng.choice(pool), index=first + i, at_s=now + over_s * i / n)
                     for i in range(n)]
            # replace() keeps the original's source: its reference is the original's.
            loop.call_soon_threadsafe(submit, batch)

        submit(reqs)
        if faults is not None:
            await faults(t0, overload)
            await asyncio.sleep(0)  # the last burst's submit runs before the gather
        await asyncio.gather(*tasks)
    return sorted(outcomes, key=lambda o: o.req.index)
