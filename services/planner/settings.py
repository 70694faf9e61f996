"""The planner's settings (``[planner]`` of a deployment's TOML, ``PDSERVE_*``, flags)."""

from __future__ import annotations

from dataclasses import dataclass

ACTUATORS = ("none", "supervisord", "kubernetes", "local")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    conductor_addr: str = "tcp://127.0.0.1:5551"
    model: str = ""  # only this model's workers count; "": every worker
    interval_s: float = 2.0  # one look at the conductor and one decision per role
    stats_timeout_s: float = 5.0
    min_prefill: int = 1
    max_prefill: int = 3
    min_decode: int = 1
    max_decode: int = 3
    # SLO pressure: 0 leaves the signal out (queues and KV usage still count).
    slo_ttft_ms: float = 0.0
    slo_tbt_ms: float = 0.0
    up_ratio: float = 0.8  # scale out above this fraction of an SLO ...
    down_ratio: float = 0.4  # ... scale in once one worker fewer stays below this one
    queue_high: float = 4.0  # waiting requests per worker that call for one more
    queue_low: float = 0.5  # ... and the most one worker fewer may leave waiting
    kv_high: float = 0.85  # KV blocks in use, as a fraction
    kv_low: float = 0.5
    up_ticks: int = 2  # consecutive looks under pressure before scaling out
    down_ticks: int = 5  # consecutive idle looks before scaling in
    cooldown_up_s: float = 30.0  # after any change of a role, before it grows again
    cooldown_down_s: float = 120.0  # ... and before it shrinks again
    actuator: str = "none"  # "none": decide, log and count only
    # supervisord: its XML-RPC URL (unix:///path/to/supervisor.sock or http://host:port)
    # and each role's programs in the order they are started (stopped in reverse).
    supervisor_url: str = ""
    supervisor_prefill: tuple[str, ...] = ("prefill",)
    supervisor_decode: tuple[str, ...] = ("decode",)
    # Kubernetes: the API server ("": in-cluster, from KUBERNETES_SERVICE_HOST/PORT),
    # the namespace ("": the service account's) and each role's Deployment.
    k8s_api: str = ""
    k8s_namespace: str = ""
    k8s_prefill: str = "pdserve-prefill"
    k8s_decode: str = "pdserve-decode"
    k8s_token_file: str = f"{SA_DIR}/token"
    k8s_ca_file: str = f"{SA_DIR}/ca.crt"
    # local: a worker's command line; {python}, {role} and {name} are filled in.
    local_command: str = "{python} -m services.{role} --worker-id {name}"
    local_log_dir: str = ""  # one log file per worker here; "": discarded
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no /metrics endpoint
    log_format: str = "json"
    curve_keys_dir: str = ""  # the planner reads stats with the "client" role's key

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if not 0 <= lo <= hi:
                raise ValueError(f"need 0 <= min_{role} <= max_{role}, got {lo} and {hi}")
        if not (self.interval_s > 0 and self.stats_timeout_s > 0):
            raise ValueError("interval_s and stats_timeout_s must be > 0")
        if self.slo_ttft_ms < 0 or self.slo_tbt_ms < 0:
            raise ValueError("slo_ttft_ms and slo_tbt_ms must be >= 0 (0: no SLO)")
        if not 0 < self.down_ratio < self.up_ratio:
            raise ValueError("need 0 < down_ratio < up_ratio: the gap is the hysteresis")
        if not 0 <= self.queue_low < self.queue_high:
            raise ValueError("need 0 <= queue_low < queue_high")
        if not 0 < self.kv_low < self.kv_high <= 1:
            raise ValueError("need 0 < kv_low < kv_high <= 1")
        if self.up_ticks < 1 or self.down_ticks < 1:
            raise ValueError("up_ticks and down_ticks must be >= 1")
        if self.cooldown_up_s < 0 or self.cooldown_down_s < 0:
            raise ValueError("cooldown_up_s and cooldown_down_s must be >= 0")
        if self.actuator == "supervisord":
            if not self.supervisor_url:
                raise ValueError("actuator supervisord needs supervisor_url")
            for role in ("prefill", "decode"):
                if len(getattr(self, f"supervisor_{role}")) < getattr(self, f"max_{role}"):
                    raise ValueError(f"supervisor_{role} names fewer programs than "
                                     f"max_{role}")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
