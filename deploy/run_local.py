"""Start the whole system on this machine under supervisord, and wait until it serves.

    python deploy/run_local.py [--config deploy/configs/local.toml] [--timeout 300] [--plain]

Each service section of the config (``[cache_pool]``, ``[conductor]``, ``[prefill]``,
``[decode]``, ``[unified]``, ``[gateway]``) runs as a supervisord program
``python -m services.<section>`` (``[cache_pool]`` is ``pdserve cache-pool``); logs go to
a scratch directory printed at start. Ctrl-C stops everything.

The control plane runs with CURVE: ``pdserve keys`` writes fresh keys into the scratch
directory and every program gets ``PDSERVE_CURVE_KEYS_DIR``. ``--plain`` leaves them out
(an unauthenticated control plane, for a trusted single host only).
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


def render(template: Path, out: Path, config: Path, run_dir: Path, sections: list[str],
           keys_dir: Path | None = None) -> None:
    """supervisord config: the template's header plus one program per service section;
    with ``keys_dir``, each program uses those CURVE keys."""
    text = template.read_text().replace("@RUN@", str(run_dir))
    text = "\n".join(line for line in text.splitlines() if not line.startswith("; "))
    env = f"PDSERVE_CONFIG=\"{config}\""
    if keys_dir is not None:
        env += f",PDSERVE_CURVE_KEYS_DIR=\"{keys_dir}\""
    for name in sections:
        text += (f"\n[program:{name}]\ncommand={sys.executable} -m services.{name}\n"
                 f"directory={ROOT}\nenvironment={env}\n"
                 f"priority={SERVICES[name]}\nautorestart=unexpected\nexitcodes=0,78\n"
                 f"stopasgroup=true\n"
                 f"stopwaitsecs={STOP_WAIT_S.get(name, 10)}\n"
                 f"redirect_stderr=true\nstdout_logfile={run_dir}/{name}.log\n")
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
    render(ROOT / "deploy" / "supervisord.conf.in", conf, config, run_dir, sections, keys_dir)
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
