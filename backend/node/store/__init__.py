"""A node's store: the tiers (DRAM, NVMe), what the node knows of each chunk, and the rules on what stays.

``TierManager`` (tiers.py) is the store's one door: each store operation is one call there (a read with
its layout check, quota count and chain touch; a put; a delete), or on the two objects it hands out
(``leasing``, ``upkeep``); moves between tiers are its own (a read promotes, the demoter demotes). The rest (the chunk table, eviction orders, quotas, pins, leases, demotion,
a put's room and landing) are its parts, which no module outside this package reaches
(tests/test_store_door.py). Imports only ``backend.node.memory`` of the node.
"""
