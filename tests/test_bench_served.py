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
