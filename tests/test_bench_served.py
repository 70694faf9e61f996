"""bench/served.py's pdserve side: the colocated config with every port moved."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from bench.harness import RunContext
from bench.served import colocated_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]


def _ports(table: dict) -> set[int]:
    found = set()
    for keys in table.values():
        for key, value in keys.items():
            if key.endswith("_port"):
                found.add(value)
            elif isinstance(value, str) and value.startswith("tcp://"):
                found.add(int(value.rpartition(":")[2]))
    return found


def test_every_port_moves_and_shared_addresses_stay_shared(tmp_path):
    ctx = RunContext("pdserve", 0, False, 1, tmp_path)
    path, http_port = colocated_config(ctx, threads=1, quantization="int4")
    base = tomllib.loads((ROOT / "deploy" / "configs" / "colocated.toml").read_text())
    new = tomllib.loads(path.read_text())
    assert not _ports(new) & _ports(base)
    assert len(_ports(new)) == len(_ports(base))
    assert new["gateway"]["http_port"] == http_port
    # The worker and the gateway still reach the conductor at its (moved) address.
    assert new["unified"]["conductor_addr"] == new["conductor"]["control_addr"]
    assert new["gateway"]["conductor_addr"] == new["conductor"]["control_addr"]
    assert new["unified"]["heartbeat_addr"] == new["conductor"]["heartbeat_addr"]
    assert new["unified"]["num_threads"] == 1
    assert new["unified"]["quantization"] == "int4"
    assert new["unified"]["model"] == base["unified"]["model"]


def test_worker_overrides_land_in_the_worker_section_only(tmp_path):
    ctx = RunContext("pdserve", 0, False, 1, tmp_path)
    overrides = parse_overrides(["max_prefill_tokens_with_decode=96", "log_level=debug",
                                 "max_waiting=8", "model=other"])
    assert overrides == {"max_prefill_tokens_with_decode": 96, "log_level": "debug",
                         "max_waiting": 8, "model": "other"}
    path, _ = colocated_config(ctx, threads=2, quantization="int8", overrides=overrides)
    new = tomllib.loads(path.read_text())  # a key set twice would not parse
    assert new["unified"]["max_prefill_tokens_with_decode"] == 96
    assert new["unified"]["log_level"] == "debug"
    assert new["unified"]["max_waiting"] == 8
    assert new["unified"]["model"] == "other"
    assert new["gateway"]["model"] == "smollm2-135m-instruct"  # other sections untouched
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["max_waiting"])


def _simulated(cap: int, seed: int = 5) -> dict:
    import argparse

    from bench.served import run_sim

    args = argparse.Namespace(
        simulate="smollm2-cpu-quiet", worker_set=[f"max_prefill_tokens_with_decode={cap}"],
        num_prompts=12, input_len=390, output_len=32, range_ratio=0.5, request_rate=0.5,
        slo_ttft_ms=5000, slo_tpot_ms=250)
    return run_sim(RunContext("pdserve-sim", 0, False, seed, Path("/nonexistent")), args)


def test_simulated_side_replays_every_request_in_virtual_time():
    plain, capped = _simulated(0), _simulated(64)  # 0: no cap
    for summary in (plain, capped):
        assert summary["completed"] == 12 and summary["failed"] == 0
        assert summary["output_throughput"] > 0
    assert _simulated(64) == capped  # virtual time: the same figures every run
    # The cap spreads prompts over more steps: the longest gap between two tokens of a
    # stream shrinks and a new prompt's first token comes later.
    assert capped["p99_itl_ms"] < plain["p99_itl_ms"]
    assert capped["mean_ttft_ms"] > plain["mean_ttft_ms"]
