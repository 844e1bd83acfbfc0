"""The implementation of kvpool. Import the public API from ``kvpool`` (docs/api.md).

The modules under ``backend`` may change in any release. This module imports nothing but
the version, so ``nccl_channel`` (which imports ``backend.errors``) loads on a GPU machine
without redis-py.
"""

from __future__ import annotations

from backend.version import __version__

__all__ = ["__version__"]
