"""A node's store: the tiers (DRAM, NVMe), what the node knows of each chunk, and the rules on what stays.

``TierManager`` (tiers.py) is the store's one door; the rest (the chunk table, eviction orders, quotas,
pins, leases, demotion, a put's landing) are its parts. Imports only ``backend.node.memory`` of the node.
"""
