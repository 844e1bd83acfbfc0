"""Disk full on a node's NVMe tier, as part of the fault suite.

The test lives in tests/test_tiers.py beside the tier it exercises (a real 3 MiB
tmpfs; skipped without root). ``make test`` runs it there; ``make faults`` runs only
tests/faults, so in full mode it is collected here too, unchanged.
"""

from __future__ import annotations

from tests.faults.proxy import FULL

if FULL:
    from tests.test_tiers import (  # noqa: F401  (pytest collects these names)
        test_a_full_disk_keeps_dram_writable_and_pauses_demotion_until_a_chunk_and_a_margin_are_free,
        tiny_disk,
    )
