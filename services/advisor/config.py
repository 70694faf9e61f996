"""The chosen deployment as a deploy/configs file: one TOML table per process kind,
loaded by every process with ``--config`` (``common/config.py``), started on one host by
``deploy/run_local.py`` (one process per table).

A deployment of several workers of one kind runs that table several times: the workers'
control, KV and metrics ports are 0 (each process takes a free port and registers the
address it got with the conductor), so any number of them can share a host. The header
says how many of each to start; nothing else in the file depends on the count.
"""

from __future__ import annotations

from pathlib import Path

from services.advisor.search import Deployment, Outcome, Plan
from services.worker.settings import WorkerSettings

MODEL = "smollm2-135m-instruct"
CONDUCTOR = "tcp://127.0.0.1:5551"
HEARTBEAT = "tcp://127.0.0.1:5552"
POOL = "tcp://127.0.0.1:5580"


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(name: str, values: dict) -> str:
    return "\n".join([f"[{name}]", *(f"{k} = {_value(v)}" for k, v in values.items())])


def render(dep: Deployment, plan: Plan, outcome: Outcome | None = None, *,
           model: str = MODEL, workload: str = "") -> str:
    """The TOML text of ``dep`` under ``plan``'s conductor settings."""
    pools = {"cache_pools": POOL} if dep.pool else {}
    cond = plan.conductor_settings(dep)
    conductor = {"control_addr": CONDUCTOR, "heartbeat_addr": HEARTBEAT,
                 "policy": cond.policy, "cost_profile": cond.cost_profile,
                 "admission": cond.admission}
    if plan.admission:
        conductor |= {"slo_ttft_ms": cond.slo_ttft_ms, "slo_tbt_ms": cond.slo_tbt_ms}
    conductor |= pools
    worker = {"model": model, "control_addr": "tcp://127.0.0.1:0",
              "conductor_addr": CONDUCTOR, "heartbeat_addr": HEARTBEAT,
              "kv_cache_mib": plan.kv_cache_mib, "kv_lease_s": plan.kv_lease_s,
              "kv_host": "127.0.0.1", "kv_port": 0} | pools
    roles = [("unified", dep.decode)] if dep.colocated else \
        [("prefill", dep.prefill), ("decode", dep.decode)]
    counts = " + ".join(f"{n} x [{r}]" for r, n in roles)
    head = [f"# pdserve advise: {dep.name} -- start {counts}"
            + (" and one [cache_pool]" if dep.pool else "") + ".",
            f"# Workload: {workload}" if workload else "",
            f"# SLOs: TTFT <= {plan.slo.ttft_s * 1e3:g} ms, TPOT <= {plan.slo.tpot_s * 1e3:g} ms; "
            f"profile {plan.profile_spec}."]
    if outcome is not None:
        ttft, tpot = outcome.ttft_s["p90"], outcome.tpot_s["p90"] * 1e3
        head.append(f"# Predicted: goodput {outcome.goodput_rps:.3g} req/s "
                    f"({outcome.good_frac:.0%} of requests within the SLOs), TTFT p90 "
                    f"{ttft:.3g} s, TPOT p90 {tpot:.3g} ms.")
    head.append("# Every key can be overridden by a flag (--key-name) or a PDSERVE_KEY_NAME "
                "variable.")
    tables = [_table("conductor", conductor)]
    tables += [_table(role, worker) for role, _ in roles]
    if dep.pool:
        tables.append(_table("cache_pool", {
            "instance_id": "pool-0", "control_addr": POOL, "events_addr": "tcp://127.0.0.1:5581",
            "dram_mib": plan.pool_mib, "policy": "reuse_aware",
            "block_tokens": WorkerSettings().block_size}))
    tables.append(_table("gateway", {
        "model": model, "http_host": "127.0.0.1", "http_port": 8000,
        "zmq_addr": "tcp://127.0.0.1:5550", "conductor_addr": CONDUCTOR,
        "stream_bind": "tcp://127.0.0.1:5553"}))
    return "\n".join(line for line in head if line) + "\n\n" + "\n\n".join(tables) + "\n"


def write(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
