"""A tensor-parallel follower: rank r > 0 of an engine (see services/engine/tp_group.py).

Started by rank 0 as ``python -m services.engine.tp_follower '<json>'`` with its rank,
the world size, the rendezvous port on loopback and the engine's settings. It loads its
shard, then runs each step rank 0 broadcasts, until a STOP plan. It speaks no ZeroMQ
and samples nothing. Any failure exits non-zero, which rank 0's watcher reports.
"""

from __future__ import annotations

import json
import signal
import sys
from datetime import timedelta

import structlog


def main(argv: list[str]) -> int:
    from services.engine.tp_group import die_with_parent

    die_with_parent()
    # Ctrl-C reaches the whole process group: rank 0 decides when followers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = json.loads(argv[0])
    rank, world = int(args["rank"]), int(args["world_size"])
    log = structlog.get_logger("tp_follower").bind(rank=rank)

    import torch.distributed as dist

    from services.engine.config import EngineConfig
    from services.engine.engine import build_runner, set_threads
    from services.engine.model_runner import StepInputs
    from services.engine.tp_group import START_TIMEOUT_S, STEP, STOP, join_group
    from services.engine.weights import load_weights

    config = EngineConfig(**args["config"])
    set_threads(config)
    store = dist.TCPStore("127.0.0.1", int(args["port"]), world, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"up/{rank}", "1")
    tp, plans = join_group(rank, world, config.rank_device(rank), store)
    weights = load_weights(config.model)
    runner, _ = build_runner(config, weights.config, weights.tensors, tp, consume=True)
    del weights  # the shard is in the model now
    steps = 0
    try:
        while True:
            kind, payload = plans.receive()
            if kind == STOP:
                break
            if kind != STEP:
                raise ValueError(f"unknown plan kind {kind}")
            runner.forward(StepInputs.from_msgpack(payload))
            steps += 1
    except Exception:
        log.exception("tensor-parallel follower failed", steps=steps)
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
