"""The cache pool as both of its sides see it; imports no torch and nothing of services/.

    keys.py        a block's key, bytes and depth, and their checks
    placement.py   which instances own a key (rendezvous hashing)
    transfer.py    block bytes on the data plane, both ends (BlockInbox, send_blocks)
    landing.py     reused memory that a client's gets land in (LandingArenas)
    client.py      PoolClient: placement, batching, replicas, failure as a miss
    instances.py   the client's control connections and which instances are down
    carrier.py     how a client's block bytes travel: the interface; one carrier per
    frames.py      client, bulk ZeroMQ frames, or
    data_plane.py  the data plane
    discovery.py   finding the instances (parse_pool_addrs, discover_pools)
"""
