#!/usr/bin/env bash
# The GPU check, in one go (about 9 minutes at most: each part has a time limit; a sweep that
# `timeout` stops with SIGTERM keeps the cells it finished, with their report and plots):
#   1. the CUDA-marked tests;
#   2. profile_train.py over every variant in the registry (eight) at GPT-2-small width,
#      n_layer 1, 4, 12, bf16 (one that cannot run on this GPU is recorded with its reason);
#   3. naive, sdpa and flex compiled and not, at n_layer 1 and 12 (each depth compiles anew,
#      and the first pays every cold compile before any cell is recorded);
#   4. scripts/after_profiler.py: whether a profiler session (CUPTI left attached) slows the
#      steps timed after it, at the sweeps' shape with 2 layers;
# then the reports, results.json, plots and traces are in OUT_DIR, and all of it in
# OUT_DIR/gpu_check.tar.gz.
# Uses whatever python3 has torch (PYTHON=... to choose); needs no network, no prepared corpus
# and no `datasets`. If the machine's python lacks tqdm/pytest/matplotlib/numpy, point WHEELS at a
# folder of wheels (make gpu-wheels GPU_PY=<its version>) and they are installed from there,
# offline, into a folder on PYTHONPATH (a system Python may refuse pip installs into itself).
#
#   bash scripts/gpu_check.sh OUT_DIR          (or: make gpu-check OUT=OUT_DIR)
# OUT_DIR: new or empty; one an earlier gpu_check wrote is moved aside (OUT_DIR.earlier-TIME),
# one that holds anything else is refused.
set -uo pipefail
OUT=${1:-gpu-check}
OUT=${OUT%/}  # gpu-check/ as tab completion gives it: the archive and the move-aside go beside it
case $OUT in /*) ;; *) [ -n "${1:-}" ] && OUT="$PWD/$OUT" ;; esac  # one given: from here
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-1,4,12}
COMPILED_LAYERS=${COMPILED_LAYERS:-1,12}
STEPS=${STEPS:-16}  # eight variants: a multiple of the 8 orders that balance 8 cells (else it warns)
COMPILED_STEPS=${COMPILED_STEPS:-18}  # 3 variants eager and compiled: of the 6 orders for 6
# No GPU, or no torch with CUDA: say so in one line, before anything is made or moved.
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
  echo "error: no CUDA GPU for $PY here (torch missing, a CPU build, or no GPU); PYTHON=... picks another python" >&2
  exit 1
}
# Every variant the registry holds, named: a default sweep would leave out those that cannot run
# here without a row; named, each is recorded with its reason.
VARIANTS=${VARIANTS:-$("$PY" -c 'from model import VARIANTS; print(",".join(VARIANTS))')} || {
  echo "error: $PY cannot import the model's registry (above); nothing was run" >&2
  exit 1
}
# A rerun into the same folder (a warm machine keeps it) moves the earlier run aside, whole:
# the sweeps refuse a folder that holds one, and its log would be overwritten. A folder that
# holds something else is not this script's to move.
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  if [ ! -f "$OUT/gpu_check.log" ]; then
    echo "error: $OUT holds files that are not an earlier gpu_check's; give a new or empty folder" >&2
    exit 1
  fi
  earlier="$OUT.earlier-$(date -u +%Y%m%dT%H%M%S)"
  mv "$OUT" "$earlier" && echo "gpu_check: the earlier run in $OUT is now in $earlier"
fi
mkdir -p "$OUT"
exec 3>&1 4>&2  # the terminal, for the end, after the log is closed
exec > >(tee "$OUT/gpu_check.log") 2>&1
log_pid=$!

echo "== $(date -u +%FT%TZ) gpu_check on $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.csv"
"$PY" -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)" \
  || { echo "error: $PY is older than Python 3.11 (tomllib is needed)"; exit 1; }
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"

missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("tqdm", "pytest", "matplotlib", "numpy") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$site" $missing \
      || { echo "error: could not install $missing from $WHEELS"; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "error: $PY lacks: $missing (set WHEELS=folder of wheels; see make gpu-wheels)"; exit 1
  fi
fi

echo "== 1. CUDA tests"
# SIGABRT, not TERM: pytest's faulthandler then prints where each thread was, so a test that
# hangs is named (killed, pytest prints no summary); stderr goes to the file too.
ulimit -c 0  # no core file of a CUDA process
# Every test file with CUDA tests: none imports tokenizers or datasets, which this python may
# lack, and no CUDA test needs a corpus prepared with them (their other tests, left out by
# -m cuda, may). pyproject's addopts give -q already: one more would hide the count line.
timeout -s ABRT -k 10 110 "$PY" -m pytest -m cuda -p no:cacheprovider -rs --durations=8 \
  tests/test_attention.py tests/test_model.py tests/test_profile_*.py tests/test_runtime.py \
  tests/test_train_step.py \
  2>&1 | tee "$OUT/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}

# Traces for one depth only (they are large on a GPU): 2 if swept, else the first depth.
case ",$LAYERS," in *,2,*) TRACE_LAYERS=2 ;; *) TRACE_LAYERS=${LAYERS%%,*} ;; esac

# A sweep's status, except where the time limit stopped a sweep that had finished: its process
# may hang on exit shutting down Inductor's compile workers (pytorch/pytorch#162199) after
# every file was written. Finished: results.json has finished_at, written after all the rest.
sweep_status() {  # DIR RC
  if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then
    if "$PY" -c 'import json, sys; sys.exit("finished_at" not in json.load(open(sys.argv[1]))["meta"])' \
      "$1/results.json" 2>/dev/null; then
      echo "gpu_check: $1 finished; the time limit stopped its process on the way out" >&2
      echo 0
      return
    fi
  fi
  echo "$2"
}

echo "== 2. sweep: $VARIANTS x n_layer $LAYERS, eager"
# The limits leave room over what an H200 took on 2026-11-30: ~115 s for this sweep; the compiled
# one wrote its report within 90 s but was still shutting down (Inductor's compile workers) at 90.
timeout -k 10 180 "$PY" profile_train.py --config configs/profile-gpu.toml --out "$OUT/eager" \
  --variants "$VARIANTS" \
  --layers "$LAYERS" --steps "$STEPS" --compile off --trace-layers "$TRACE_LAYERS"
eager_rc=$(sweep_status "$OUT/eager" $?)

echo "== 3. sweep: naive, sdpa, flex compiled and not, n_layer $COMPILED_LAYERS"
timeout -k 10 150 "$PY" profile_train.py --config configs/profile-gpu.toml --out "$OUT/compiled" \
  --variants naive,sdpa,flex --layers "$COMPILED_LAYERS" --steps "$COMPILED_STEPS" --compile both --no-traces
compiled_rc=$(sweep_status "$OUT/compiled" $?)

echo "== 4. steps timed before and after profiler sessions"
timeout -k 10 60 "$PY" scripts/after_profiler.py --config configs/profile-gpu.toml \
  2>&1 | tee "$OUT/after_profiler.txt"
after_rc=${PIPESTATUS[0]}

echo "== $(date -u +%FT%TZ) done: tests rc=$tests_rc, eager sweep rc=$eager_rc, compiled sweep rc=$compiled_rc, after_profiler rc=$after_rc"
# Everything in one file too, to carry off the machine: the log closed first, so it is whole;
# the archive made beside the folder, then moved in.
exec 1>&3 2>&4 3>&- 4>&-
wait "$log_pid" 2>/dev/null
packed=$(mktemp "$OUT.tar.gz.XXXXXX") && chmod 644 "$packed" \
  && tar czf "$packed" -C "$OUT" . && mv "$packed" "$OUT/gpu_check.tar.gz" \
  && echo "gpu_check: all of it in $OUT/gpu_check.tar.gz" \
  || { rm -f "${packed:-}"; echo "gpu_check: could not pack $OUT into one archive" >&2; }
[ "$tests_rc" -eq 0 ] && [ "$eager_rc" -eq 0 ] && [ "$compiled_rc" -eq 0 ] && [ "$after_rc" -eq 0 ]
