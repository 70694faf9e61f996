"""bench/throughput.py hands pdserve's weight format to its side's process, and only
to pdserve's engine."""

from __future__ import annotations

import argparse

from bench import throughput


def _args(**kw) -> argparse.Namespace:
    base = dict(num_prompts=4, output_len=8, model="m", kv_cache_mib=64, dtype="float32",
                max_batched_tokens=256, threads=1, quantization="w4a16")
    return argparse.Namespace(**{**base, **kw})


def test_child_command_carries_the_quantization():
    cmd = throughput.child_cmd("ours", _args(), seed=7)
    assert cmd[cmd.index("--quantization") + 1] == "w4a16"
    assert cmd[cmd.index("--seed") + 1] == "7"
    cmd = throughput.child_cmd("transformers", _args(quantization="none"), seed=7)
    assert cmd[cmd.index("--quantization") + 1] == "none"
