#!/usr/bin/env bash
# The GPU part of the NCCL channel in one run (a few minutes): every test marked `gpu`,
# then the NCCL bandwidth and staging measurement and the channel's whole path
# (bench/nccl/path.py). Results go to $OUT when it is set.
#
# Runs as-is on a GPU machine that has Python, torch (CUDA), nvidia-nccl, numpy, xxhash
# and safetensors but no redis-py, no lmcache and no network: pytest and its plugins
# travel as wheels in .whl/ (git-ignored; fetch them with bench/device_wheels.sh) and are
# installed into a private directory here.
#
# Exit status: 0 when the check passed, or when this machine has no CUDA GPU (said so,
# nothing measured); 1 when a GPU check failed; 2 when the environment is broken (torch,
# nccl_channel or pytest does not import, the wheels do not install, or a GPU is visible
# but NCCL cannot run) -- a broken environment never passes for "no GPU".
# Usage: bench/device_check.sh     (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export LMCACHE_TRACK_USAGE=false PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
DEST=${OUT:-}
[ -n "$DEST" ] && mkdir -p "$DEST"
note() { echo "$1"; [ -n "$DEST" ] && echo "$1" >> "$DEST/device_check.txt"; }
broken() { note "device check: BROKEN environment: $1"; exit 2; }

shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/kvpool-device-site.XXXXXX")
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    || broken "the ${#wheels[@]} wheels in .whl/ did not install with $PY"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

# One probe: what this machine has, whether the channel's code imports, whether NCCL can run.
probe=$("$PY" - <<'EOF' 2>&1
import json, platform, sys
report = {"python": platform.python_version()}
try:
    import numpy, safetensors, torch, xxhash  # what the channel and its tests import
    import pytest
    import nccl_channel, nccl_channel.channel, nccl_channel.communicator, nccl_channel.library
except Exception as exc:  # any import failure is the finding
    print(json.dumps({**report, "broken": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
status = nccl_channel.available()
report.update(torch=torch.__version__, torch_cuda=torch.version.cuda, gpus=status.gpus,
              gpu=torch.cuda.get_device_name(0) if status.gpus else "", pytest=pytest.__version__,
              nccl_ok=status.ok, nccl_library=status.library, nccl_version=status.version, reason=status.reason,
              redis_py="redis" in sys.modules, lmcache="lmcache" in sys.modules)
print(json.dumps(report))
EOF
)
summary=$(printf '%s\n' "$probe" | tail -n 1)
field() { "$PY" -c "import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2], ''))" "$summary" "$1" 2>/dev/null; }
[ -n "$(field python)" ] || broken "$PY could not run the probe: $probe"
[ -z "$(field broken)" ] || broken "$(field broken) (with $PY, Python $(field python)); carry missing wheels with bench/device_wheels.sh"
note "python $(field python), torch $(field torch) (CUDA build $(field torch_cuda)), pytest $(field pytest)"
note "libnccl: $(field nccl_library) version $(field nccl_version); NCCL channel usable: $(field nccl_ok) $(field reason)"
gpus=$(field gpus)
if [ "$gpus" = "0" ]; then
  note "device check: no CUDA GPU visible here; the GPU part is unmeasured (GPU tests not run, no bandwidth figures)."
  exit 0
fi
note "GPU: $gpus x $(field gpu)"
[ "$(field nccl_ok)" = "True" ] || broken "a GPU is visible but the NCCL channel cannot run: $(field reason)"

status=0
timeout 240 "$PY" -m pytest -m gpu -v -s -p no:cacheprovider tests/test_nccl_gpu.py \
  ${DEST:+--junitxml="$DEST/gpu_tests.xml"} 2>&1 | tee ${DEST:+"$DEST/gpu_tests.log"}
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The channel's whole path (--path): a batch from an mmap'd /dev/shm arena through staging, NCCL and into
# pinned sinks, checksums verified, beside ceilings and the issue's targets (PASS/MISS; a MISS is a finding,
# not a failure of the check: only a wrong byte or a crash fails it).
timeout 300 "$PY" -m bench.nccl.bandwidth --sizes-mib 2,32,256 --iters 20 --path \
  ${DEST:+--json "$DEST/nccl_bandwidth.json"} 2>&1 | tee ${DEST:+"$DEST/nccl_bandwidth.txt"}
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ -n "$DEST" ] && [ -f "$DEST/nccl_bandwidth.json" ]; then
  note "path targets: $("$PY" -c 'import json, sys; t = json.load(open(sys.argv[1])).get("path", {}).get("targets", {}); print(", ".join(k + (" PASS" if v["pass"] else " MISS") for k, v in t.items()) or "none")' "$DEST/nccl_bandwidth.json" 2>&1)"
fi
if [ "$status" = 0 ]; then
  note "device check: passed on $gpus GPU(s)$([ "$gpus" -lt 2 ] && echo '; the two-process test needs 2 GPUs and was skipped')."
else
  note "device check: FAILED (see the logs above)."
fi
exit $status
