"""Serving clients: the accept loop and sessions, the handshake's admission, and one handler per request op.

Receives the node's context; reaches the store through ``TierManager`` only.
"""
