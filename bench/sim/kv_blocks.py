"""Re-export of ``services.sim.kv_blocks``."""

from services.sim.kv_blocks import KVBlocks, PoolTier  # noqa: F401
