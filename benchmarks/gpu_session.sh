#!/usr/bin/env bash
# One bounded GPU session (issues 20, 22, 24): run from the repository root as
#
#     OUT=/some/folder bash benchmarks/gpu_session.sh
#
# on a machine with one NVIDIA GPU, Python 3 with jax[cuda], torch (CUDA), equinox,
# pytest (pytest-xdist if present). memento need not be installed: src/ is put on
# PYTHONPATH. Every part runs under `timeout`; the caps sum to 420 s:
#
#   (a) pytest: tests/loops/test_scan.py, test_scan_recursion.py, test_scan_host.py   80 s
#   (b) benchmarks/offload.py (device peak, host bytes, time, xla#46231 canary)       50 s
#       benchmarks/device_budget.py (two-level vs one-level temp bytes per executor)  30 s
#   (c) tests/pytorch/test_torch_device.py (memento.torch on CUDA)                    20 s
#       benchmarks/torch_rnn.py, torch_chain.py --device cuda                    40 + 30 s
#   (d) benchmarks/gpu_policy.py: auto against forced plans, LSTM and 4x4 cell,
#       each also with CUDA graphs on per function                              60 + 60 s
#   (e) benchmarks/small_loops.py at 10^4 steps (per-gradient ratios to the model)     50 s
#
# Writes, flat in $OUT: session.log (everything printed), offload.json, device_budget.json
# (and each case's optimised HLO in device_budget_hlo/), torch_rnn.json,
# torch_chain.json, lstm_policy.json, cell_policy.json, small_loops.json (also under
# benchmarks/results/gpu/). One part failing does not stop the others.
#
# GPU_SESSION_QUICK=1: tiny sizes on whatever device there is (CPU here), results in a
# temporary folder, to check that every part starts.

set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
QUICK=${GPU_SESSION_QUICK:-0}
OUT=${OUT:-$(mktemp -d /tmp/gpu_session.XXXXXX)}
mkdir -p "$OUT"
LOG="$OUT/session.log"
: >"$LOG"
if [ "$QUICK" = 1 ]; then
    RES=$(mktemp -d /tmp/gpu_session_results.XXXXXX)
else
    RES=benchmarks/results/gpu
fi
mkdir -p "$RES"

. "$(dirname "$0")/_parts.sh"
collect() {
    for f in offload.json device_budget.json torch_rnn.json torch_chain.json \
        lstm_policy.json cell_policy.json small_loops.json; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/$f"
    done
}

say "memento GPU session; OUT=$OUT; quick=$QUICK; commit $(git rev-parse --short HEAD 2>/dev/null)"
(nvidia-smi -L || echo "nvidia-smi: not available") 2>&1 | tee -a "$LOG"
part versions 30 "$PY" -c '
import sys, jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
try:
    import torch
    print("torch", torch.__version__, "| cuda", torch.version.cuda,
          "| available", torch.cuda.is_available())
except Exception as e:
    print("torch: not importable:", e)
for m in ("equinox", "optax", "diffrax", "xdist", "pytest_timeout"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "present"))
    except Exception as e:
        print(m, "missing:", type(e).__name__)
print("jax.devices():", jax.devices())
'

# (a) the scan tests on the GPU. They need none of the packages the GPU machine lacks
# (checkpoint_schedules, beartype): nothing is deselected. Each xdist worker is a process
# of its own on the one GPU, so none may preallocate its memory.
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
TESTS=(tests/loops/test_scan.py tests/loops/test_scan_recursion.py tests/loops/test_scan_host.py)
if [ "$QUICK" = 1 ]; then
    XDIST=(); TESTS=(tests/loops/test_scan_host.py -k "host_stores or vmap_jit")
fi
part pytest 80 env XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PY" -m pytest -o addopts="" -q -p no:cacheprovider "${XDIST[@]}" "${TESTS[@]}"

# (b) host offload at equal device memory, with the canary for openxla/xla#46231.
if [ "$QUICK" = 1 ]; then
    part offload 50 "$PY" benchmarks/offload.py --quick --isolate --fracs 0.2 \
        --time-budget 40 --out "$RES/offload.json"
else
    part offload 50 "$PY" benchmarks/offload.py --isolate --fracs 0.05,0.2 \
        --time-budget 45 --case-timeout 28 --out "$RES/offload.json"
fi
part device_budget 30 "$PY" benchmarks/device_budget.py --out "$RES/device_budget.json" \
    --hlo "$OUT/device_budget_hlo"
collect

# (c) memento.torch on CUDA (torch there may be older than pyproject's floor: printed).
if [ "$QUICK" = 1 ]; then
    TDEV=cpu; RNN=(--steps 64 --batch 4 --hidden 8); CHAIN=(--repeats 1)
else
    TDEV=cuda; RNN=(--steps 1000 --batch 128 --hidden 1024); CHAIN=(--repeats 5)
fi
part torch_tests 20 "$PY" -m pytest -o addopts="" -q -p no:cacheprovider -rs \
    tests/pytorch/test_torch_device.py
part torch_rnn 40 "$PY" benchmarks/torch_rnn.py --device "$TDEV" "${RNN[@]}" --no-headline \
    --repeats 5 --out "$RES/torch_rnn.json"
part torch_chain 30 "$PY" benchmarks/torch_chain.py --device "$TDEV" "${CHAIN[@]}" \
    --out "$RES/torch_chain.json"
collect

# (d) auto's picks against forced policies and executors (issue 20): the LSTM and the 4x4
# cell, in one process each. auto charges the rows per step on a GPU since this part's
# first LSTM run (results/gpu/lstm_policy.json); it should now plan HSM in every case.
# (gpu_rnn.py, the part here before, has its results in results/gpu/gpu_rnn*.json.)
if [ "$QUICK" = 1 ]; then
    POLICY=(--small --repeats 1)
else
    POLICY=(--repeats 3 --command-buffers)
fi
part gpu_policy_lstm 60 "$PY" benchmarks/gpu_policy.py "$RES/lstm_policy.json" \
    --problem lstm "${POLICY[@]}"
part gpu_policy_cell 60 "$PY" benchmarks/gpu_policy.py "$RES/cell_policy.json" \
    --problem cell "${POLICY[@]}"
collect

# (e) the small bodies of issue 20 on the GPU: memento (rows, recursion) against the
# checkpointed scan and the plan's model; XLA:CPU's threshold flag does not apply here.
if [ "$QUICK" = 1 ]; then
    part small_loops 50 "$PY" benchmarks/small_loops.py --steps 1e3 --widths 4 \
        --thresholds default --repeats 1 --out "$RES/small_loops.json"
else
    part small_loops 50 "$PY" benchmarks/small_loops.py --steps 1e4 --widths 4 \
        --thresholds default --repeats 3 --out "$RES/small_loops.json"
fi
collect

say "done; files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
