"""Keeping Redis in step with what the node holds: the id claim, heartbeat and index flush, republish, the reaper, NVMe recovery.

Receives the node's context; never imports ``backend.node.serve``.
"""
