"""The cache pool as both of its sides see it; imports no torch and nothing of services/.

    keys.py        a block's key, bytes and depth, and their checks
    placement.py   which instances own a key (rendezvous hashing)
    transfer.py    block bytes on the data plane, both ends (BlockInbox, send_blocks)
    client.py      PoolClient: placement, batching, replicas, failure as a miss
"""
