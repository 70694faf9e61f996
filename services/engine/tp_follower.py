"""A tensor-parallel follower: rank r > 0 of an engine (see services/engine/tp_group.py).

Started by rank 0 as ``python -m services.engine.tp_follower '<json>'`` with its rank,
the world size, the rendezvous port on loopback and the engine's settings. It loads its
shard, then runs each step rank 0 broadcasts, and takes part in its KV gathers and
scatters (``tp_kv.py``), or sends its KV heads' slice straight to a decode worker
(``tp_direct.py``), or, on a decode worker, receives its heads' slices on a receiver of
its own (``tp_recv.py``), until a STOP plan. It speaks no ZeroMQ
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

    import msgpack
    import torch.distributed as dist

    from services.engine.config import EngineConfig
    from services.engine.engine import build_runner, set_threads
    from services.engine.model_runner import StepInputs
    from services.engine.tp_group import (
        KV_DROP,
        KV_EXPECT,
        KV_IN,
        KV_LISTEN,
        KV_OUT,
        START_TIMEOUT_S,
        STEP,
        STEP_EXPORT,
        STOP,
        join_group,
    )
    from services.engine.tp_kv import FollowerKV, unpack_ops
    from services.engine.tp_recv import FollowerReceiver
    from services.engine.weights.source import weights_for

    config = EngineConfig(**args["config"])
    set_threads(config)
    store = dist.TCPStore("127.0.0.1", int(args["port"]), world, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"up/{rank}", "1")
    tp, plans, kv_group = join_group(rank, world, config.rank_device(rank), store)
    weights = weights_for(config)
    runner, _ = build_runner(config, weights.config, weights.tensors, tp, consume=True)
    del weights  # the shard is in the model now
    kv = FollowerKV(runner.kv_cache, kv_group, rank)
    receiver = FollowerReceiver(runner.kv_cache, rank, store)
    steps = 0
    try:
        while True:
            kind, payload = plans.receive()
            if kind == STOP:
                break
            if kind == STEP:
                runner.forward(StepInputs.from_msgpack(payload))
                steps += 1
            elif kind == STEP_EXPORT:
                block_ids, inputs, direct, _ = msgpack.unpackb(payload)
                runner.forward(StepInputs.from_msgpack(inputs),
                               kv.step_hook(block_ids, direct))
                kv.end_step()
                steps += 1
            elif kind == KV_IN:
                kv.import_(unpack_ops(payload))
            elif kind == KV_OUT:
                kv.export(unpack_ops(payload))
            elif kind in (KV_LISTEN, KV_EXPECT, KV_DROP):
                receiver.apply(kind, payload)
            else:
                raise ValueError(f"unknown plan kind {kind}")
    except Exception:
        log.exception("tensor-parallel follower failed", steps=steps)
        return 1
    finally:
        kv.direct.close()
        receiver.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
