from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from tests.tiny_models import load_reference, make_tiny_model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved tiny model per architecture, shared by the session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "llama3")}


@pytest.fixture(scope="session")
def references(tiny_dirs):
    return {arch: load_reference(path) for arch, path in tiny_dirs.items()}


@pytest.fixture
def make_engine():
    """Build engines; after the test, assert none leaked a block."""
    from services.engine.engine import LLMEngine

    engines = []

    def build(model, hooks=None, **kw):
        kw.setdefault("dtype", "float64")
        extra = {} if hooks is None else {"hooks": hooks}
        engine = LLMEngine(EngineConfig(model=str(model), **kw), **extra)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        held = [r for r, s in engine.requests.items() if s.hold_blocks]
        for rid in held:
            engine.release(rid)
        engine.block_manager.check_invariants()
        assert not engine.requests, f"requests left behind: {list(engine.requests)}"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """The default model's tokenizer exported once per session, in a private cache."""
    from services.engine.tokenizer_export import tokenizer_dir_for

    cache = tmp_path_factory.getbasetemp() / "pdserve-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE", str(cache))
        return tokenizer_dir_for("smollm2-135m-instruct")


@pytest.fixture
async def ctx():
    """A ZeroMQ asyncio context, destroyed after the test."""
    import zmq.asyncio

    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def pools(tmp_path):
    """Make cache-pool processes (``tests.pool_procs.PoolProc``); all killed after."""
    import signal

    from tests.pool_procs import PoolProc

    made: list[PoolProc] = []

    def make(instance: str = "a", **kw) -> PoolProc:
        kw.setdefault("curve", False)  # the test's own sockets speak to it directly
        made.append(PoolProc(instance, tmp_path, **kw))
        return made[-1]

    yield make
    for proc in made:
        proc.stop(signal.SIGKILL)
