"""The LMCache harness: each backend driven by LMCache's own code, side by side, byte-checked (``python -m bench.harness.run``)."""
