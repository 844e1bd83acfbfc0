"""What tests of LMCache stacks share: comparing the memory objects they return (``backend.lmcache.stack``), and
building kvpool's multiprocess-mode L2 adapter as ``lmcache server`` does."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["build_adapter", "same_bytes"]


def same_bytes(a: Any, b: Any) -> bool:
    """Two LMCache memory objects hold the same bytes (whatever their dtype)."""
    import torch  # here: importing this module costs no torch until a test compares objects

    return bool(torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)))


def build_adapter(url: str, **params: Any) -> Any:
    """The adapter as ``lmcache server`` builds it: ``--l2-adapter`` JSON -> plugin factory."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    from backend.lmcache.config import lmcache_mp_adapter

    spec = lmcache_mp_adapter(url)
    spec["adapter_params"].update(params)
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter(config.adapters[0])
