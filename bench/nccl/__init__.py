"""The NCCL channel on a GPU: its path and bandwidth against the same run's ceilings (bench/device_check.sh runs them)."""
