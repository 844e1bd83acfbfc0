"""Where a node's chunk bytes live: the shared-memory arena, its pages and small-chunk cells, chunk buffers, per-slot columns.

Imports nothing of the node above it: the store is built on these, never the other way round.
"""
