"""The shipped deployment files agree with the code: every section of every config loads
into its service's settings, run_local makes one program per section running the right
module, the systemd units cover the services, and local.toml's peers point at each other."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import tomllib

import pytest

from common.config import load_settings
from common.service_main import EXIT_CONFIG
from services.cache_pool.settings import PoolSettings
from services.conductor.server import ConductorSettings
from services.gateway.server import GatewaySettings
from services.worker.handshake import WorkerRefused
from services.worker.settings import WorkerSettings
from tests.cluster import ROOT

_spec = importlib.util.spec_from_file_location("run_local", ROOT / "deploy" / "run_local.py")
run_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_local)

CONFIGS = sorted((ROOT / "deploy" / "configs").glob("*.toml"))
SETTINGS = {"conductor": ConductorSettings, "gateway": GatewaySettings,
            "prefill": WorkerSettings, "decode": WorkerSettings, "unified": WorkerSettings,
            "cache_pool": PoolSettings}
# Keys naming what a service binds (a worker's conductor_addr and heartbeat_addr connect).
BIND_KEYS = {"control_addr", "events_addr", "zmq_addr", "stream_bind", "kv_port",
             "metrics_port", "http_port"}
SECTIONS = [(c.name, s) for c in CONFIGS for s in tomllib.loads(c.read_text())]


def test_every_service_has_settings_and_a_module():
    assert set(run_local.SERVICES) == set(SETTINGS)
    for name in SETTINGS:
        assert importlib.util.find_spec(f"services.{name}") is not None, name


@pytest.mark.parametrize(("config", "section"), SECTIONS)
def test_each_section_loads_into_its_services_settings(config, section):
    assert section in SETTINGS, f"{config}: [{section}] is no service run_local knows"
    path = ROOT / "deploy" / "configs" / config
    table = tomllib.loads(path.read_text())[section]
    settings = load_settings(SETTINGS[section], section, ["--config", str(path)], env={})
    assert {k: getattr(settings, k) for k in table} == table


def test_local_toml_peers_point_at_each_other():
    t = tomllib.loads((ROOT / "deploy" / "configs" / "local.toml").read_text())
    pool = t["cache_pool"]["control_addr"]
    assert t["conductor"]["cache_pools"] == pool == "tcp://127.0.0.1:5580"
    assert t["prefill"]["cache_pools"] == t["decode"]["cache_pools"] == pool
    assert t["cache_pool"]["events_addr"] == "tcp://127.0.0.1:5581"
    for s in ("prefill", "decode", "gateway"):
        assert t[s]["conductor_addr"] == t["conductor"]["control_addr"]
    binds = [v for name, sec in t.items() for k, v in sec.items() if k in BIND_KEYS
             or (name, k) == ("conductor", "heartbeat_addr")]
    ports = [int(str(v).rsplit(":", 1)[-1]) for v in binds]
    assert len(ports) == len(set(ports)) == 14, sorted(ports)


def test_run_local_renders_the_cache_pool_program(tmp_path):
    config = ROOT / "deploy" / "configs" / "local.toml"
    sections = [n for n in run_local.SERVICES if n in tomllib.loads(config.read_text())]
    assert sections == ["cache_pool", "conductor", "prefill", "decode", "gateway"]
    out = tmp_path / "supervisord.conf"
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, config, tmp_path, sections)
    programs = dict(re.findall(r"\[program:(\w+)\]\ncommand=\S+ -m (\S+)\n", out.read_text()))
    assert programs == {n: f"services.{n}" for n in sections}
    block = out.read_text().split("[program:cache_pool]")[1].split("[program:")[0]
    assert "priority=5\n" in block and "stopwaitsecs=25\n" in block


def test_systemd_units_cover_the_services_of_local_toml():
    units = ROOT / "deploy" / "systemd"
    target = (units / "pdserve.target").read_text()
    t = tomllib.loads((ROOT / "deploy" / "configs" / "local.toml").read_text())
    for section in t:
        unit = f"pdserve-{section.replace('_', '-')}.service"
        text = (units / unit).read_text()
        assert re.search(rf"^ExecStart=\S+ -m services\.{section}$", text, re.M), unit
        assert "WantedBy=pdserve.target" in text and unit in target


def test_run_local_hands_every_program_the_curve_keys(tmp_path):
    config = ROOT / "deploy" / "configs" / "local.toml"
    sections = [n for n in run_local.SERVICES if n in tomllib.loads(config.read_text())]
    out = tmp_path / "supervisord.conf"
    keys = tmp_path / "keys"
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, config, tmp_path, sections,
                     keys)
    envs = re.findall(r"^environment=(.*)$", out.read_text(), re.M)
    assert len(envs) == len(sections)
    assert all(f'PDSERVE_CURVE_KEYS_DIR="{keys}"' in e for e in envs)
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, config, tmp_path, sections)
    assert "CURVE" not in out.read_text()  # --plain


def test_systemd_units_hand_every_service_the_curve_keys():
    """Every unit names the same keys directory through the variable the settings read,
    so a systemd deployment does not fall back to the unauthenticated plain mode."""
    dirs = set()
    for unit in sorted((ROOT / "deploy" / "systemd").glob("*.service")):
        found = re.findall(r"^Environment=PDSERVE_CURVE_KEYS_DIR=(\S+)$", unit.read_text(),
                           re.M)
        assert len(found) == 1, unit.name
        dirs.update(found)
    assert dirs == {"/etc/pdserve/keys"}
    for cls in set(SETTINGS.values()):  # the variable is PDSERVE_ + a setting's name
        s = load_settings(cls, "x", [], env={"PDSERVE_CURVE_KEYS_DIR": "/etc/pdserve/keys"})
        assert s.curve_keys_dir == "/etc/pdserve/keys", cls.__name__


@pytest.mark.parametrize("config", [c.name for c in CONFIGS])
def test_every_decode_capable_worker_bounds_its_queue(config):
    """A shipped config states ``max_waiting`` for each worker that admits requests
    (decode, unified), at most its batch size's worth by default, never the bare default."""
    path = ROOT / "deploy" / "configs" / config
    t = tomllib.loads(path.read_text())
    sections = [s for s in t if s in ("decode", "unified")]
    assert sections, config
    for section in sections:
        assert "max_waiting" in t[section], f"{config}: [{section}]"
        s = load_settings(WorkerSettings, section, ["--config", str(path)], env={})
        assert 1 <= s.max_waiting <= s.max_num_seqs, (config, section, s.max_waiting)


def test_systemd_restarts_a_crash_but_not_a_refusal():
    """Restart=on-failure restarts exit 1 and signals; exit 78 (EX_CONFIG, a worker the
    conductor refused) is kept from it, as a restart would only be refused again."""
    assert WorkerRefused.exit_code == EXIT_CONFIG == 78
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert len(units) == 5
    for unit in units:
        text = unit.read_text()
        assert re.findall(r"^Restart=(.*)$", text, re.M) == ["on-failure"], unit.name
        assert re.findall(r"^RestartPreventExitStatus=(.*)$", text, re.M) == ["78"], unit.name


def _program_options(run_dir) -> dict[str, str]:
    """The restart options run_local gives the decode program."""
    config = ROOT / "deploy" / "configs" / "local.toml"
    out = run_dir / "rendered.conf"
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, config, run_dir, ["decode"])
    block = out.read_text().split("[program:decode]")[1]
    options = dict(re.findall(r"^(\w+)=(.*)$", block, re.M))
    return {k: options[k] for k in ("autorestart", "exitcodes")}


@pytest.mark.timeout(60)
def test_supervisord_restarts_a_crash_but_not_a_refusal(tmp_path):
    """A real supervisord with run_local's restart options: a program that exits 1 is
    started again, one that exits 78 stays down. Each program lives past supervisord's
    startsecs (1 s), as a worker does while it loads its model and says Hello."""
    options = _program_options(tmp_path)
    assert options == {"autorestart": "unexpected", "exitcodes": "0,78"}
    supervisord = os.path.join(os.path.dirname(sys.executable), "supervisord")
    if not os.path.exists(supervisord):
        pytest.skip("supervisord is not installed")
    text = (ROOT / "deploy" / "supervisord.conf.in").read_text().replace("@RUN@", str(tmp_path))
    for name, code in (("crashes", 1), ("refused", 78), ("stops", 0)):
        starts = tmp_path / f"{name}.starts"
        script = (f"open({str(starts)!r}, 'a').write('x'); import time, sys; "
                  f"time.sleep(1.3); sys.exit({code})")
        text += (f"\n[program:{name}]\ncommand={sys.executable} -c \"{script}\"\n"
                 f"autorestart={options['autorestart']}\nexitcodes={options['exitcodes']}\n"
                 "startretries=0\n")
    conf = tmp_path / "supervisord.conf"
    conf.write_text(text)
    proc = subprocess.Popen([supervisord, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        crashes = tmp_path / "crashes.starts"
        while time.monotonic() < deadline:  # the crashing one comes back at least twice
            if crashes.exists() and len(crashes.read_text()) >= 3:
                break
            time.sleep(0.2)
        assert len(crashes.read_text()) >= 3
        assert (tmp_path / "refused.starts").read_text() == "x"
        assert (tmp_path / "stops.starts").read_text() == "x"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
