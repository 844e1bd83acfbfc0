"""Hostile peers: each attack on a running pool as a test (docs/security.md)."""
