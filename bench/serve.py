"""Online serving benchmark against any OpenAI-compatible endpoint.

    python bench/serve.py --base-url http://127.0.0.1:8000 --model NAME \\
        [--endpoint completions|chat] --dataset random|shared-prefix|trace \\
        [--num-prompts N] [--request-rate R] [--max-concurrency C] [--seed S] \\
        [--input-len L --output-len L --range-ratio R]               # random
        [--num-groups G --prefix-len P --suffix-len S]               # shared-prefix
        [--trace PATH --block-size 512 --time-scale 1.0 \\
         --max-input-len L --max-output-len L --max-requests N]      # trace
        [--slo-ttft-ms MS --slo-tpot-ms MS] [--label NAME] [--out DIR] [--api-key KEY]

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``, the
default, sends them all at once) or, for ``--dataset trace``, at the trace's timestamps
scaled by ``--time-scale``. ``--max-concurrency`` bounds the requests in flight; a request
waiting for a slot has not started, so its wait is not part of its latency.

Prompts are token ids. ``/v1/completions`` takes them as a list of ints in ``prompt``,
so prompt lengths are exact without a tokenizer. ``/v1/chat/completions`` needs text:
the ids are written as decimal words (``"1834 922 40017"``), which the server's tokenizer
turns into some other number of tokens; ``usage.prompt_tokens`` then gives the real
length. Each request asks for exactly its output length: ``max_tokens`` with
``ignore_eos``, greedy, streamed, with usage in the last chunk.

Per request: TTFT (to the first chunk carrying text), ITLs (gaps between such chunks),
end-to-end latency, output tokens (``usage.completion_tokens``, else the number of text
chunks), and for a failure (non-2xx status, an error event, a dropped connection, a
stream without text) its message. The summary reports mean/p50/p90/p99 of TTFT, TPOT
(``(e2e - ttft) / (out - 1)`` per request), ITL and E2E in ms, throughputs, and goodput
under the SLOs given. It prints a table and writes ``serve-<label>.json`` (summary and
per-request records) and ``serve-<label>.png`` (TTFT and ITL CDFs) under ``--out``.

In-process use: ``build_requests(parse_args([...]))`` → ``run_benchmark(...)`` →
``summarize(results, results_duration(results), Slo(...))``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make `bench.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.datasets import (  # noqa: E402
    TRACE_BLOCK_TOKENS,
    RequestSpec,
    random_requests,
    shared_prefix_requests,
    trace_requests,
)
from bench.serve_report import (  # noqa: E402
    RequestResult,
    Slo,
    format_summary,
    plot_cdfs,
    results_duration,
    summarize,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# --------------------------------------------------------------------------- client


def endpoint_url(base_url: str, endpoint: str) -> str:
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
    base = base_url.rstrip("/")
    base = base.removesuffix("/v1")
    return base + ENDPOINT_PATHS[endpoint]


def prompt_text(prompt: Sequence[int]) -> str:
    """The chat stand-in for a token-id prompt: the ids as decimal words."""
    return " ".join(map(str, prompt))


def request_body(spec: RequestSpec, model: str, endpoint: str) -> dict:
    body = {
        "model": model,
        "max_tokens": spec.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt_text(spec.prompt)}]
    else:
        body["prompt"] = list(spec.prompt)
    return body


async def sse_data(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, float]]:
    """Each ``data:`` payload with the time its bytes arrived. One data line is one event,
    which is how OpenAI-compatible servers stream."""
    buf = b""
    async for piece in stream.iter_any():
        now = time.perf_counter()
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode(), now
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip().decode(), time.perf_counter()


def error_message(body: str) -> str:
    """The message of an OpenAI-style error body, else the body itself (shortened)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail"):
                if err.get(key):
                    return str(err[key])[:300]
        elif isinstance(err, str):
            return err[:300]
    return body.strip()[:300]


def _stream_error(chunk: dict) -> str | None:
    if "error" in chunk or chunk.get("object") == "error":
        return error_message(json.dumps(chunk))
    return None


def _has_text(chunk: dict, endpoint: str) -> bool:
    # Chat servers open with a role-only delta; counting it would make TTFT ~0.
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                return True
        elif choice.get("text"):
            return True
    return False


async def send_request(session: aiohttp.ClientSession, url: str, headers: dict,
                       spec: RequestSpec, index: int, model: str, endpoint: str,
                       t0: float) -> RequestResult:
    """Send one streamed request and time it; any failure is recorded, never raised."""
    start = time.perf_counter()
    ttft = None
    last = start
    itl: list[float] = []
    chunks = 0
    usage: dict = {}
    error = None
    try:
        async with session.post(url, json=request_body(spec, model, endpoint),
                                headers=headers) as resp:
            if resp.status >= 300:
                error = f"HTTP {resp.status}: {error_message(await resp.text())}"
            else:
                async for data, now in sse_data(resp.content):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    error = _stream_error(chunk)
                    if error:
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if _has_text(chunk, endpoint):
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
                        chunks += 1
    # A load generator must outlive any one request: whatever went wrong belongs to it.
    except Exception as e:
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    if error is None and chunks == 0:
        error = "stream ended without any text"
    return RequestResult(
        index=index, prompt_len=spec.prompt_len, output_len=spec.output_len,
        success=error is None,
        output_tokens=int(usage.get("completion_tokens", chunks)) if error is None else chunks,
        prompt_tokens=usage.get("prompt_tokens"),
        ttft_s=ttft, itl_s=tuple(itl), e2e_s=end - start,
        arrival_s=spec.arrival_s, start_s=start - t0, error=error)


async def run_benchmark(base_url: str, specs: Sequence[RequestSpec], *, model: str,
                        endpoint: str = "completions", max_concurrency: int | None = None,
                        api_key: str | None = None, timeout_s: float | None = 3600.0,
                        progress: bool = True) -> list[RequestResult]:
    """Send every spec at its ``arrival_s`` and return the results in spec order.

    Never raises for a failed request; failures come back as results with ``success``
    false. ``max_concurrency`` (None: unbounded) caps the requests in flight.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    url = endpoint_url(base_url, endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # limit=0: aiohttp's default pool of 100 connections would quietly cap concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    bar = tqdm(total=len(specs), file=sys.stderr, disable=not progress, unit="req",
               desc="requests")

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(index: int, spec: RequestSpec) -> RequestResult:
            if slots is None:
                result = await send_request(session, url, headers, spec, index, model,
                                            endpoint, t0)
            else:
                async with slots:
                    result = await send_request(session, url, headers, spec, index, model,
                                                endpoint, t0)
            bar.update(1)
            return result

        tasks = []
        for index in sorted(range(len(specs)), key=lambda i: specs[i].arrival_s):
            delay = t0 + specs[index].arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, specs[index])))
        results = await asyncio.gather(*tasks)
    bar.close()
    return sorted(results, key=lambda r: r.index)


# --------------------------------------------------------------------------- summary


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    ap.add_argument("--dataset", choices=["random", "shared-prefix", "trace"],
                    default="random")
    ap.add_argument("--num-prompts", type=int, default=100,
                    help="requests to send (random and shared-prefix)")
    ap.add_argument("--request-rate", type=float, default=None,
                    help="Poisson arrivals per second; inf (default) sends all at once. "
                         "Not for --dataset trace, which has its own timestamps")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=49152,
                    help="token ids are drawn from [100, vocab-size)")
    g = ap.add_argument_group("random")
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=128,
                   help="also the output length of shared-prefix requests")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths are uniform in len × [1 - r, 1 + r]")
    g = ap.add_argument_group("shared-prefix")
    g.add_argument("--num-groups", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=128)
    g = ap.add_argument_group("trace (Mooncake JSONL)")
    g.add_argument("--trace", help="e.g. /work/shared/traces/mooncake_conversation_trace.jsonl")
    g.add_argument("--block-size", type=int, default=TRACE_BLOCK_TOKENS,
                   help="tokens per hash id; below 512 scales prompts down")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="arrival = timestamp (ms) × this")
    g.add_argument("--max-input-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=None)
    g.add_argument("--max-requests", type=int, default=None, help="replay only the first N")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--request-timeout", type=float, default=3600.0, help="seconds")
    ap.add_argument("--label", default=None, help="names the outputs (default: the dataset)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.dataset == "trace":
        if not args.trace:
            ap.error("--dataset trace needs --trace PATH")
        if args.request_rate is not None:
            ap.error("--request-rate does not apply to --dataset trace; use --time-scale")
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    return args


def build_requests(args: argparse.Namespace) -> list[RequestSpec]:
    rate = math.inf if args.request_rate is None else args.request_rate
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, args.vocab_size, rate, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.num_groups, args.prefix_len,
                                      args.suffix_len, args.output_len, args.vocab_size,
                                      rate, args.seed)
    if args.dataset == "trace":
        return trace_requests(args.trace, args.block_size, args.time_scale, args.vocab_size,
                              args.max_input_len, args.max_output_len, args.max_requests)
    raise ValueError(f"unknown dataset {args.dataset!r}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    label = args.label or args.dataset
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    specs = build_requests(args)
    if not specs:
        sys.exit("no requests to send")
    results = asyncio.run(run_benchmark(
        args.base_url, specs, model=args.model, endpoint=args.endpoint,
        max_concurrency=args.max_concurrency, api_key=args.api_key,
        timeout_s=args.request_timeout, progress=not args.no_progress))
    summary = summarize(results, results_duration(results), slo)
    print(format_summary(summary, label))

    out = Path(args.out)
    # JSON has no infinity; keep the secret out of the file.
    config = {k: "inf" if isinstance(v, float) and math.isinf(v) else v
              for k, v in vars(args).items() if k != "api_key"}
    write_json(out / f"serve-{label}.json", label, config, summary, results)
    plot_cdfs(out / f"serve-{label}.png", label, results, slo)
    print(f"wrote {out / f'serve-{label}.json'} and .png", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
