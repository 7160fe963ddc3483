#!/usr/bin/env bash
# GPU check for specdeploy (see tests/gpu/README.md). Usage:
#   tests/gpu/run_gpu_check.sh [REPORT_DIR]        # default: $OUT, else build/gpu_check
# Environment: PYTHON (default python3), WHEELS (offline wheels dir, default .whl),
#   GPU_CHECK_PIP=auto|0 (try the package index for missing pieces; auto = only when reachable),
#   GPU_CHECK_EXPORT=DIR (test an export made elsewhere), GPU_CHECK_BUDGET_S (default 420).
# Finishes within ~8 minutes: installs are time-boxed and the python step has its own budget.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
REPORT=${1:-${OUT:-$REPO/build/gpu_check}}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-420}
mkdir -p "$REPORT"
LOG="$REPORT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
T0=$(date +%s)
say() { echo "[gpu-check] $*"; }

# The repository root is the package: a symlink named specdeploy makes it importable, no install.
SITE=$(mktemp -d /tmp/specdeploy_site.XXXX)
ln -s "$REPO" "$SITE/specdeploy"
DEPS="$SITE/deps"
mkdir -p "$DEPS"
export PYTHONPATH="$DEPS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

# Wheels carried along (offline): installed into a private dir that shadows the image's versions.
WHEELS=${WHEELS:-$REPO/.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  say "installing carried wheels from $WHEELS"
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$DEPS" "$WHEELS"/*.whl \
    || say "carried wheels did not install (continuing without them)"
fi

# Missing pieces from the package index, only when it answers; each install is time-boxed.
PIP=${GPU_CHECK_PIP:-auto}
if [ "$PIP" != 0 ] && timeout 15 "$PY" -m pip download -q --no-deps -d "$SITE/probe" polygraphy >/dev/null 2>&1; then
  say "package index reachable"
  have polygraphy || timeout 60 "$PY" -m pip install -q --target "$DEPS" --no-deps polygraphy || say "polygraphy: not installed"
  if ! have tensorrt; then
    timeout 240 "$PY" -m pip install -q --target "$DEPS" tensorrt || say "tensorrt: not installed"
  fi
  if ! "$PY" -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" >/dev/null 2>&1; then
    timeout 120 "$PY" -m pip install -q --target "$DEPS" --no-deps onnxruntime-gpu || say "onnxruntime-gpu: not installed"
  fi
else
  say "package index not reachable (or GPU_CHECK_PIP=0): using what the image has"
fi

# onnxruntime-gpu ships the CUDA provider but loads CUDA/cuDNN from pip wheels when asked.
"$PY" -c "import onnxruntime as o; getattr(o, 'preload_dlls', lambda: None)()" >/dev/null 2>&1 || true

SPENT=$(( $(date +%s) - T0 ))
LEFT=$(( BUDGET - SPENT ))
[ "$LEFT" -lt 120 ] && LEFT=120
say "setup took ${SPENT}s; running checks with a ${LEFT}s budget"
ARGS=(--report "$REPORT" --work "$SITE/work" --budget-s "$LEFT")
[ -f "$REPO/build/family/micro/family.json" ] && ARGS+=(--family "$REPO/build/family/micro")
[ -n "${GPU_CHECK_EXPORT:-}" ] && ARGS+=(--export "$GPU_CHECK_EXPORT")
[ -f "$REPO/build/test_exports/micro/manifest.json" ] && ARGS+=(--fallback-export "$REPO/build/test_exports/micro")
timeout $(( LEFT + 60 )) "$PY" "$REPO/tests/gpu/gpu_check.py" "${ARGS[@]}"
RC=$?
say "done in $(( $(date +%s) - T0 ))s (exit $RC); report: $REPORT/report.md, $REPORT/report.json"
exit $RC
