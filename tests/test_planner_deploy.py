"""``run_local.py --planner N``: spare worker programs that supervisord does not start,
each binding its own ports, and a planner program whose settings name exactly those
programs, supervisord's socket and the conductor of the config."""

from __future__ import annotations

import re
import shlex
import tomllib

from common.address import parse_address
from common.config import load_settings
from services.planner.settings import PlannerSettings
from services.worker.settings import WorkerSettings
from tests.cluster import ROOT
from tests.test_deploy_configs import BIND_KEYS, run_local

CONFIG = ROOT / "deploy" / "configs" / "local.toml"


def programs(text: str) -> dict[str, dict[str, str]]:
    out = {}
    for block in text.split("\n[program:")[1:]:
        name, _, body = block.partition("]\n")
        out[name] = dict(line.split("=", 1) for line in body.splitlines() if "=" in line)
    return out


def test_spare_workers_and_the_planner_that_starts_them(tmp_path):
    table = tomllib.loads(CONFIG.read_text())
    sections = [n for n in run_local.SERVICES if n in table]
    out = tmp_path / "supervisord.conf"
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, CONFIG, tmp_path, sections,
                     tmp_path / "keys", spares=3)
    progs = programs(out.read_text())
    spares = {"prefill-2", "prefill-3", "decode-2", "decode-3"}
    assert set(progs) == set(sections) | spares | {"planner"}
    assert {n for n, p in progs.items() if p.get("autostart") == "false"} == spares
    env = {"PDSERVE_CONFIG": str(CONFIG)}
    ports = [int(str(v).rsplit(":", 1)[-1]) for sec in table.values()
             for k, v in sec.items() if k in BIND_KEYS] + [table["conductor"]["heartbeat_addr"]
                                                          .rsplit(":", 1)[-1]]
    ports = [int(p) for p in ports]
    for name in sorted(spares):
        role = name.split("-")[0]
        argv = shlex.split(progs[name]["command"])
        assert argv[1:3] == ["-m", f"services.{role}"]
        s = load_settings(WorkerSettings, role, argv[3:], env=env)
        assert s.worker_id == name and int(progs[name]["stopwaitsecs"]) >= 12
        ports += [parse_address(s.control_addr).port, s.metrics_port] + (
            [s.kv_port] if role == "decode" else [])
    assert len(ports) == len(set(ports)), sorted(ports)  # every process its own ports
    argv = shlex.split(progs["planner"]["command"])
    assert argv[1:3] == ["-m", "services.planner"]
    p = load_settings(PlannerSettings, "planner", argv[3:], env=env)
    assert p.actuator == "supervisord"
    assert p.supervisor_url == f"unix://{tmp_path}/supervisor.sock"
    assert re.search(rf"^file={re.escape(str(tmp_path))}/supervisor.sock$", out.read_text(), re.M)
    assert p.supervisor_prefill == ("prefill", "prefill-2", "prefill-3")
    assert p.supervisor_decode == ("decode", "decode-2", "decode-3")
    assert (p.min_prefill, p.max_prefill, p.min_decode, p.max_decode) == (1, 3, 1, 3)
    assert p.conductor_addr == table["conductor"]["control_addr"]
    assert p.metrics_port not in ports
    assert all('PDSERVE_CURVE_KEYS_DIR' in prog["environment"] for prog in progs.values())


def test_without_the_planner_nothing_changes(tmp_path):
    table = tomllib.loads(CONFIG.read_text())
    sections = [n for n in run_local.SERVICES if n in table]
    out = tmp_path / "supervisord.conf"
    run_local.render(ROOT / "deploy" / "supervisord.conf.in", out, CONFIG, tmp_path, sections)
    assert set(programs(out.read_text())) == set(sections)
