"""The cache pool's storage core: eviction policies, DRAM and SSD tiers, the tiered
block store, and rendezvous placement across pool instances. Imports no torch: blocks
are opaque bytes keyed by their 64-bit chained block hash (``common.block_hash``)."""
