#!/usr/bin/env bash
# One bounded GPU session for benchmarks/pareto.py: run from the repository root as
#
#     OUT=/some/folder bash benchmarks/gpu_pareto.sh
#
# on a machine with one NVIDIA GPU and Python 3 with jax[cuda], equinox, pytest
# (pytest-xdist if present). memento need not be installed: src/ is put on PYTHONPATH.
# Every part runs under `timeout`; the caps sum to 430 s:
#
#   (a) pareto.py, T = 10^4, the headline's five bodies, auto and static,
#       then the first call of the 4-float cell at T = 10^5                         230 s
#   (b) the static executor's tests, the plan's explanation, the platform's          90 s
#   (c) pareto.py, T = 10^4, every other body, auto only                             100 s
#
# Float32 matrix products run at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest):
# an NVIDIA GPU's default rounds their operands to TF32, and every gradient is checked
# against lax.scan's. A mismatch is recorded, and the run goes on (--keep-going).
#
# Writes, flat in $OUT: session.log (everything printed), pareto.json, pareto_more.json
# (each rewritten after every body, so a part stopped by its cap keeps what it measured).
#
# GPU_PARETO_QUICK=1: tiny sizes on whatever device there is (CPU here), to check that
# every part starts.

set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="src:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_DEFAULT_MATMUL_PRECISION=highest
PY=${PYTHON:-python3}
QUICK=${GPU_PARETO_QUICK:-0}
OUT=${OUT:-$(mktemp -d /tmp/gpu_pareto.XXXXXX)}
mkdir -p "$OUT"
LOG="$OUT/session.log"
: >"$LOG"

. "$(dirname "$0")/_parts.sh"

if [ "$QUICK" = 1 ]; then
    STEPS=300; FIRST=1e3; ROUNDS=1; HEAD=tanh4,lstm32; MORE=scalar,attn32
    TESTS=(tests/loops/test_platform.py)
else
    STEPS=1e4; FIRST=1e5; ROUNDS=3; HEAD=tanh4,elem256,matvec128,lstm32,lstm256
    MORE=gru64,velocity64,scalar,elem4096,rk4mlp,mixed256,counter16,conv8x128,attn32,bigx8,ysbig8,bf16c512
    TESTS=(tests/loops/test_scan_static.py tests/loops/test_explain.py tests/loops/test_platform.py)
fi

say "memento pareto on a GPU; OUT=$OUT; quick=$QUICK; commit $(git rev-parse --short HEAD 2>/dev/null)"
(nvidia-smi -L || echo "nvidia-smi: not available") 2>&1 | tee -a "$LOG"
part versions 30 "$PY" -c '
import sys, jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
for m in ("equinox", "xdist"):
    try:
        print(m, getattr(__import__(m), "__version__", "present"))
    except Exception as e:
        print(m, "missing:", type(e).__name__)
print("jax.devices():", jax.devices())
'

# (a) The headline: memento at its peers' bytes, as XLA:GPU counts them.
part pareto 230 "$PY" benchmarks/pareto.py --steps "$STEPS" --bodies "$HEAD" \
    --executors auto,static --rounds "$ROUNDS" --keep-going --first-call \
    --first-call-steps "$FIRST" --first-call-rounds 2 --out "$OUT/pareto.json"

# (b) The static executor's tests. Each xdist worker is a process of its own on the one
# GPU (no preallocation, above); -v names each test as it ends, so a part stopped by its
# cap still says which passed.
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
part tests 90 "$PY" -m pytest -o addopts="" -v -p no:cacheprovider "${XDIST[@]}" "${TESTS[@]}"

# (c) The other bodies, auto only.
part pareto_more 100 "$PY" benchmarks/pareto.py --steps "$STEPS" --bodies "$MORE" \
    --executors auto --rounds "$ROUNDS" --keep-going --out "$OUT/pareto_more.json"

say "done; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
