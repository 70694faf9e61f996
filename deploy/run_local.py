"""Start the whole system on this machine under supervisord, and wait until it serves.

    python deploy/run_local.py [--config deploy/configs/local.toml] [--timeout 300] [--plain]
                               [--planner N]

Each service section of the config (``[cache_pool]``, ``[conductor]``, ``[prefill]``,
``[decode]``, ``[unified]``, ``[gateway]``) runs as a supervisord program
``python -m services.<section>`` (``[cache_pool]`` is ``pdserve cache-pool``); logs go to
a scratch directory printed at start. Ctrl-C stops everything.

The control plane runs with CURVE: ``pdserve keys`` writes fresh keys into the scratch
directory and every program gets ``PDSERVE_CURVE_KEYS_DIR``. ``--plain`` leaves them out
(an unauthenticated control plane, for a trusted single host only).

``--planner N`` adds spare workers and the planner that starts and stops them: programs
``prefill-2`` .. ``prefill-N`` and ``decode-2`` .. ``decode-N`` (``autostart=false``; each
the section's worker with every port it binds moved up by ``SPARE_PORT_STEP`` per spare)
and ``planner`` (``pdserve planner --actuator supervisord``, on supervisord's unix
socket, scaling each role between 1 and N; a ``[planner]`` section of the config tunes
the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Start order: the cache pool, the conductor, workers, the gateway last. (Conductor and
# workers keep looking for pool instances that are not up yet, so the order is a nicety.)
SERVICES = {"cache_pool": 5, "conductor": 10, "prefill": 20, "decode": 20, "unified": 20,
            "gateway": 30}
# Seconds supervisord waits after SIGTERM before SIGKILL: the pool copies DRAM to SSD
# first. Under the 30 s ``stop`` below gives supervisord.
STOP_WAIT_S = {"cache_pool": 25}
SPARE_PORT_STEP = 100  # spare k binds the section's ports + (k - 1) * SPARE_PORT_STEP
PLANNER_METRICS_PORT = 9105
# A stopped spare drains first: a prefill worker up to its KV lease (10 s) after telling
# the conductor (2 s); a decode worker hands its requests back within seconds.
SPARE_STOP_WAIT_S = 20


def _program(name: str, command: str, env: str, priority: int, run_dir: Path, *,
             stop_wait_s: int = 10, autostart: bool = True) -> str:
    start = "" if autostart else "autostart=false\n"  # a spare waits for the planner
    return (f"\n[program:{name}]\ncommand={command}\ndirectory={ROOT}\nenvironment={env}\n"
            f"priority={priority}\n{start}"
            f"autorestart=unexpected\nexitcodes=0,78\nstopasgroup=true\nstopwaitsecs={stop_wait_s}\n"
            f"redirect_stderr=true\nstdout_logfile={run_dir}/{name}.log\n")


def _moved(addr: str, by: int) -> str:
    head, _, port = addr.rpartition(":")
    return f"{head}:{int(port) + by}" if int(port) else addr


def planner_programs(table: dict, env: str, run_dir: Path, spares: int) -> str:
    """Spare workers 2..``spares`` of each worker section (not started) and the planner
    that starts them through supervisord's XML-RPC socket."""
    text, names = "", {}
    for role in ("prefill", "decode"):
        if role not in table:
            continue
        sec = table[role]
        names[role] = [role]
        for k in range(2, spares + 1):
            by = (k - 1) * SPARE_PORT_STEP
            args = ["--worker-id", f"{role}-{k}", "--control-addr",
                    _moved(sec.get("control_addr", "tcp://127.0.0.1:0"), by)]
            for key in ("kv_port", "metrics_port"):
                if sec.get(key):
                    args += [f"--{key.replace('_', '-')}", str(sec[key] + by)]
            text += _program(f"{role}-{k}", f"{sys.executable} -m services.{role} "
                             + " ".join(args), env, SERVICES[role], run_dir, autostart=False,
                             stop_wait_s=SPARE_STOP_WAIT_S)
            names[role].append(f"{role}-{k}")
    conductor = table["conductor"].get("control_addr", "tcp://127.0.0.1:5551")
    args = ["--actuator", "supervisord", "--supervisor-url", f"unix://{run_dir}/supervisor.sock",
            "--conductor-addr", conductor, "--metrics-port", str(PLANNER_METRICS_PORT)]
    for role, programs in names.items():
        args += [f"--supervisor-{role}", ",".join(programs), f"--min-{role}", "1",
                 f"--max-{role}", str(len(programs))]
    return text + _program("planner", f"{sys.executable} -m services.planner " + " ".join(args),
                           env, 40, run_dir)


def render(template: Path, out: Path, config: Path, run_dir: Path, sections: list[str],
           keys_dir: Path | None = None, spares: int = 0) -> None:
    """supervisord config: the template's header plus one program per service section;
    with ``keys_dir``, each program uses those CURVE keys; with ``spares`` > 1, spare
    workers and the planner (see the module docstring)."""
    text = template.read_text().replace("@RUN@", str(run_dir))
    text = "\n".join(line for line in text.splitlines() if not line.startswith("; "))
    env = f"PDSERVE_CONFIG=\"{config}\""
    if keys_dir is not None:
        env += f",PDSERVE_CURVE_KEYS_DIR=\"{keys_dir}\""
    for name in sections:
        text += _program(name, f"{sys.executable} -m services.{name}", env, SERVICES[name],
                         run_dir, stop_wait_s=STOP_WAIT_S.get(name, 10))
    if spares > 1:
        text += planner_programs(tomllib.loads(config.read_text()), env, run_dir, spares)
    out.write_text(text)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "deploy" / "configs" / "local.toml"))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--plain", action="store_true",
                    help="no CURVE keys: an unauthenticated control plane")
    ap.add_argument("--planner", type=int, default=0, metavar="N",
                    help="run the planner, scaling prefill and decode between 1 and N")
    args = ap.parse_args()
    config = Path(args.config).resolve()
    table = tomllib.loads(config.read_text())
    sections = [name for name in SERVICES if name in table]
    if "gateway" not in sections or "conductor" not in sections:
        print(f"pdserve: {config} needs [conductor] and [gateway] sections")
        return 2
    gateway = table["gateway"]
    base = f"http://{gateway.get('http_host', '127.0.0.1')}:{gateway.get('http_port', 8000)}"
    model = gateway.get("model", "smollm2-135m-instruct")

    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    conf = run_dir / "supervisord.conf"
    keys_dir = None if args.plain else run_dir / "keys"
    if keys_dir is not None:
        subprocess.run([sys.executable, "-m", "services.cli", "keys", "--out", str(keys_dir)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    render(ROOT / "deploy" / "supervisord.conf.in", conf, config, run_dir, sections, keys_dir,
           spares=args.planner)
    print(f"pdserve: starting {', '.join(sections)} (logs in {run_dir})")
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)],
                            start_new_session=True)

    def stop(*_):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        print("\npdserve: stopped")
        sys.exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + args.timeout
    while not healthy(base + "/health"):
        if proc.poll() is not None:
            print(f"pdserve: supervisord exited ({proc.returncode}); see {run_dir}")
            return 1
        if time.monotonic() > deadline:
            print(f"pdserve: not ready after {args.timeout:.0f} s; see logs in {run_dir}")
            stop()
        time.sleep(1)
    body = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    print(f"\npdserve is ready at {base}  (OpenAI API under {base}/v1)\n")
    print(f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"       -d '{body}'\n")
    print("Ctrl-C stops everything.")
    proc.wait()
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
