"""Settings: defaults < TOML < PDSERVE_* variables < flags, with clear errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.config import load_settings


@dataclass(frozen=True, slots=True)
class Demo:
    port: int = 1
    name: str = "x"
    ratio: float = 0.5
    flag: bool = False
    keys: tuple[str, ...] = ()
    limit: int | None = None


def test_priority_order(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[demo]\nport = 2\nname = "toml"\nratio = 0.25\n')
    s = load_settings(Demo, "demo", ["--config", str(cfg), "--name", "flag"],
                      env={"PDSERVE_PORT": "3", "PDSERVE_KEYS": "a, b", "PDSERVE_FLAG": "yes"})
    assert s == Demo(port=3, name="flag", ratio=0.25, flag=True, keys=("a", "b"), limit=None)
    assert load_settings(Demo, "demo", ["--limit", "7"], env={}).limit == 7


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="port.*PDSERVE_PORT"):
        load_settings(Demo, "demo", [], env={"PDSERVE_PORT": "eighty"})
    cfg = tmp_path / "c.toml"
    cfg.write_text("[demo]\nbogus = 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load_settings(Demo, "demo", ["--config", str(cfg)], env={})
    with pytest.raises(ValueError, match="flag"):
        load_settings(Demo, "demo", ["--flag", "maybe"], env={})


def test_ucx_settings_reach_the_environment(monkeypatch):
    from common.config import apply_ucx_settings

    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    monkeypatch.setenv("UCX_TLS", "rc")  # restored after the test
    apply_ucx_settings("tcp,self", "")
    import os

    assert os.environ["UCX_TLS"] == "tcp,self"
    assert os.environ["UCX_NET_DEVICES"] == "eth9"  # empty setting: left alone
