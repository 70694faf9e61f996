"""Time to first token of a lone long prompt: disaggregated against colocated.

    python bench/lone_prompt.py [--prompt-len 2048] [--trials 3]

Both deployments get two torch threads per worker (nothing else runs, so they do not
compete). Disaggregated, token 0 comes from the prefill worker while each layer's KV
streams to the decode worker; token 1 is decode's first step after the last layer
lands. Reports the median TTFT and time to token 1 of each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from deployments import DEPLOYMENTS, start, stop  # noqa: E402

from common.client import Client  # noqa: E402


def measure(prompt_len: int, trials: int, seed: int) -> dict:
    rng = random.Random(seed)
    ttft, second = [], []
    with Client("tcp://127.0.0.1:5550", timeout_s=300) as client:
        client.generate(prompt_token_ids=[rng.randrange(100, 49152) for _ in range(64)],
                        max_tokens=2)  # warm-up
        for _ in range(trials):
            prompt = [rng.randrange(100, 49152) for _ in range(prompt_len)]  # no cache hit
            t0 = time.perf_counter()
            stamps = [time.perf_counter() - t0 for _ in client.stream(
                prompt_token_ids=prompt, max_tokens=2, temperature=0, ignore_eos=True)]
            ttft.append(stamps[0])
            second.append(stamps[1])
    return {"ttft_s": statistics.median(ttft), "token1_s": statistics.median(second),
            "ttft_all": ttft, "token1_all": second}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    results = {}
    for name, config in DEPLOYMENTS.items():
        proc = start(config, env={"PDSERVE_NUM_THREADS": "2"})
        try:
            results[name] = measure(args.prompt_len, args.trials, seed=7)
        finally:
            stop(proc)
    d, c = results["disaggregated"], results["colocated"]
    print(f"lone {args.prompt_len}-token prompt   disaggregated   colocated   ratio")
    for key in ("ttft_s", "token1_s"):
        print(f"{key:>28} {d[key]:>12.3f} s {c[key]:>9.3f} s {d[key] / c[key]:>6.2f}x")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "lone_prompt.json").write_text(json.dumps({"args": vars(args), **results}, indent=2))


if __name__ == "__main__":
    main()
