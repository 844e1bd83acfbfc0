"""Benchmarks, the demo, and the LMCache harness they share with the tests."""
