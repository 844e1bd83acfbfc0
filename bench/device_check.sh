#!/usr/bin/env bash
# The GPU part of the NCCL channel in one run (under 5 minutes): every test marked `gpu`,
# then the NCCL bandwidth measurement. Results go to $OUT when it is set.
# Usage: bench/device_check.sh     (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export LMCACHE_TRACK_USAGE=false PYTHONDONTWRITEBYTECODE=1
DEST=${OUT:-}
[ -n "$DEST" ] && mkdir -p "$DEST"
note() { echo "$1"; [ -n "$DEST" ] && echo "$1" >> "$DEST/device_check.txt"; }

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
"$PY" -c "import nccl_channel; s = nccl_channel.available(); print('nccl_channel.available():', s.ok, s.reason or s.library + ' ' + s.version)" \
  | tee ${DEST:+"$DEST/available.txt"}
if [ "$gpus" = "0" ]; then
  note "device check: no CUDA GPU visible here; the GPU part is unmeasured (GPU tests skipped, no bandwidth figures)."
  exit 0
fi

status=0
timeout 200 "$PY" -m pytest -m gpu -v -s -p no:cacheprovider tests/test_nccl_gpu.py \
  ${DEST:+--junitxml="$DEST/gpu_tests.xml"} 2>&1 | tee ${DEST:+"$DEST/gpu_tests.log"}
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 90 "$PY" -m bench.nccl_bandwidth --sizes-mib 2,32,256 --iters 20 ${DEST:+--json "$DEST/nccl_bandwidth.json"} \
  2>&1 | tee ${DEST:+"$DEST/nccl_bandwidth.txt"}
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ "$status" = 0 ]; then
  note "device check: passed on $gpus GPU(s)$([ "$gpus" -lt 2 ] && echo '; the two-process test needs 2 GPUs and was skipped')."
else
  note "device check: FAILED (see the logs above)."
fi
exit $status
