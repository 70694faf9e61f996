"""Settings of a model worker (prefill, decode or unified role)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from services.engine.model_config import preset

ROLES = ("prefill", "decode", "unified")
EXECUTORS = ("model", "sim")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: str = "unified"
    worker_id: str = ""  # empty: <role>-<host>-<pid>
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when present, else cpu; or cpu, cuda, cuda:N
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere; or force one
    block_size: int = 16
    kv_cache_mib: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 0  # cap on one prompt's tokens per step; 0: the step's budget
    # Cap on a step's prompt tokens while any request decodes, so that a new prompt
    # delays running streams by at most this much prefill per token; 0: no cap.
    max_prefill_tokens_with_decode: int = 0
    max_model_len: int = 0  # 0: the model's own context length
    num_threads: int = 0  # torch intra-op threads; 0: one per CPU the process may run on
    quantization: str = "none"  # int8/int4/w8a16/w4a16/w8a8/w4a8: CPU (EngineConfig)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; bfloat16, int8: less KV (CPU)
    # A shape preset (llama-3-8b, llama-3.1-8b, tiny) with random weights drawn from
    # random_seed instead of loading `model`, which then only names it; empty: off.
    random_weights: str = ""
    random_seed: int = 0
    cuda_graphs: str = "auto"  # decode steps from CUDA graphs: auto (on with CUDA), on, off
    # Ranks the model is split over; rank 0 is this process, the rest its followers.
    tensor_parallel_size: int = 1
    control_addr: str = "tcp://127.0.0.1:0"  # where this worker's ROUTER binds
    kv_host: str = "127.0.0.1"  # data plane listener (decode and unified roles)
    kv_port: int = 0
    advertise_host: str = ""  # host peers dial for control and KV; empty: the bound one
    transfer_backend: str = "auto"  # auto: negotiate per peer; or force tcp, shm or ucx
    ucx_tls: str = ""  # UCX_TLS for the ucx backend, e.g. "rc,sm,self"; empty: UCX's choice
    ucx_net_devices: str = ""  # UCX_NET_DEVICES, e.g. "mlx5_0:1"; empty: UCX's choice
    conductor_addr: str = "tcp://127.0.0.1:5551"
    heartbeat_addr: str = "tcp://127.0.0.1:5552"
    heartbeat_interval_s: float = 1.0
    kv_lease_s: float = 10.0  # how long decode waits for remote KV before prefilling itself
    # On SIGTERM, move running requests with their KV to other decode workers; false (or
    # when that fails): hand them back to their gateways, which recompute them elsewhere.
    migrate_on_stop: bool = True
    # Requests that may wait here for their first step; more are refused at once with
    # Error("overloaded", retry_after_s): a bounded queue, and a refusal before any wait.
    max_waiting: int = 256
    metrics_port: int = 0  # 0: no /metrics endpoint
    host_id: str = ""  # empty: this machine's hostname
    log_format: str = "json"
    log_level: str = "info"  # debug adds a line per engine step (rows, prompt tokens, ms)
    curve_keys_dir: str = ""  # CURVE keys (pdserve keys); empty: plain, trusted host only
    tracing: bool = False  # OpenTelemetry spans (docs/tracing.md)
    tracing_endpoint: str = ""  # OTLP/HTTP collector
    tracing_file: str = ""  # spans as JSON lines
    executor: str = "model"  # "model": the real engine; "sim": sleep what sim_profile says
    sim_profile: str = "smollm2-cpu"  # cost profile name (deploy/profiles) or JSON path
    sim_time_scale: float = 1.0  # multiplies the simulated step times
    cpu_affinity: str = ""  # CPUs to pin the process to, e.g. "0" or "0-3,6"; empty: any
    cache_pools: str = ""  # cache-pool control addresses, comma-separated; empty: no pool
    pool_min_fetch_blocks: int = 1  # fetch pooled prefixes of at least this many blocks
    pool_write_back: bool = True  # put computed prompt blocks into the pool
    pool_bandwidth_mbs: float = 1000.0  # pool fetch speed assumed until one is measured
    pool_timeout_s: float = 2.0  # a pool call slower than this is a miss
    pool_replicas: int = 1  # pool instances each written block goes to (rendezvous order)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transfer_backend not in ("auto", "tcp", "shm", "ucx"):
            raise ValueError("transfer_backend must be auto, tcp, shm or ucx, "
                             f"got {self.transfer_backend!r}")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be debug, info, warning or error, "
                             f"got {self.log_level!r}")
        if self.prefill_chunk_size < 0 or self.max_prefill_tokens_with_decode < 0:
            raise ValueError("prefill_chunk_size and max_prefill_tokens_with_decode must be "
                             ">= 0 (0: no cap)")
        if self.kv_lease_s <= 0:
            raise ValueError("kv_lease_s must be positive")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.sim_time_scale < 0:
            raise ValueError("sim_time_scale must be >= 0")
        parse_cpus(self.cpu_affinity)
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.random_weights:
            preset(self.random_weights)  # ValueError naming the known presets
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto, on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.device == "cpu":
            raise ValueError("cuda_graphs on needs a CUDA device")
        if self.quantization not in ("none", "int8", "int4", "w8a16", "w4a16", "w8a8",
                                     "w4a8"):
            raise ValueError("quantization must be none, int8, int4, w8a16, w4a16, w8a8 or "
                             f"w4a8, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16 or int8, "
                             f"got {self.kv_cache_dtype!r}")
        if self.pool_min_fetch_blocks < 1 or self.pool_replicas < 1 \
                or not self.pool_bandwidth_mbs > 0 or not self.pool_timeout_s > 0:
            raise ValueError("pool_min_fetch_blocks and pool_replicas must be >= 1, "
                             "pool_bandwidth_mbs and pool_timeout_s > 0")

    @property
    def use_cuda_graphs(self) -> bool | None:
        """``cuda_graphs`` as ``EngineConfig`` takes it: None leaves it to the device."""
        return {"auto": None, "on": True, "off": False}[self.cuda_graphs]

    @property
    def resolved_host_id(self) -> str:
        return self.host_id or socket.gethostname()


def parse_cpus(spec: str) -> set[int]:
    """CPU ids from a list like "0", "0,2" or "0-3,6"; empty for ""; ValueError if bad."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu_affinity: {part!r} is not a CPU id or range") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_affinity: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus
