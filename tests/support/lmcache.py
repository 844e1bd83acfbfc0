"""What tests of LMCache stacks (``bench.lmcache_stack``) share: comparing the memory objects they return."""

from __future__ import annotations

from typing import Any

__all__ = ["same_bytes"]


def same_bytes(a: Any, b: Any) -> bool:
    """Two LMCache memory objects hold the same bytes (whatever their dtype)."""
    import torch  # here: importing this module costs no torch until a test compares objects

    return bool(torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)))
