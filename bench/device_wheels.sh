#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels bench/device_check.sh needs on a GPU machine
# that has none: pytest and its plugins, for Python 3.12 on x86-64 Linux (all pure Python).
# They land in .whl/ (git-ignored); device_check.sh installs whatever it finds there.
# Versions are pinned, one of each: two versions of one package stop the whole install.
# Usage: bench/device_wheels.sh     (PYTHON=... to choose the pip that downloads)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
WHEELS=(
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0  # pytest and what it requires
  pytest-timeout==2.4.0  # pyproject.toml sets a per-test timeout
)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -1 .whl
