#!/usr/bin/env bash
# The GPU run: CUDA tests and the GPU side of the benchmarks, in one short script (about 8 minutes on an
# H200). Run from the repository root on a machine with a CUDA GPU, torch and (for the JAX part) jax with
# CUDA; polyamp is used from src/ (no install). Each part's output goes to the terminal and to
# $OUT/<part>.log (OUT defaults to gpu-out/). docs/BENCHMARKS.md ("GPU run") holds what it printed.
#
#     bash benchmarks/gpu_checks.sh [part ...]
#
# parts: env tests overhead doctor proofs quantize jax jax-strict (the last: XLA without excess precision,
# so every fp16 intermediate is rounded as the CPU rounds it), and check, not in the default list:
# benchmarks/gpu_check.py (about 9 minutes: polyamp vs native AMP in torch, TF and JAX, polyamp compare
# and polyamp tune, written to $OUT/gpu_check.{json,md}); it supersedes the overhead part. Run it alone:
#     bash benchmarks/gpu_checks.sh check        (or: python3 benchmarks/gpu_check.py --out $OUT)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PARTS="${*:-env tests overhead doctor proofs quantize jax jax-strict}"

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

for p in $PARTS; do
    case $p in
    env) part env 30 bash -c "nvidia-smi -L; $PY -c 'import sys, numpy, torch; print(sys.version); \
print(\"numpy\", numpy.__version__, \"torch\", torch.__version__, torch.cuda.get_device_name())'" ;;
    tests) part tests 120 "$PY" -m pytest -q -p no:cacheprovider -W ignore::RuntimeWarning tests/test_cuda.py \
        tests/test_quantize_frameworks.py tests/test_doctor_torch.py tests/test_torch_recipes.py ;;
    overhead) part overhead 90 "$PY" benchmarks/overhead_torch.py --device cuda --batch-mult 16 \
        --repeats 15 --fp16-repeats 15 ;;
    doctor) part doctor 60 "$PY" benchmarks/doctor_overhead_torch.py --device cuda --repeats 15 ;;
    proofs) part proofs 80 "$PY" benchmarks/doctor_proofs_torch.py --device cuda ;;
    quantize) part quantize 40 "$PY" benchmarks/quantize_torch.py --device cuda --n 4096 --repeats 7 ;;
    jax) part jax 70 "$PY" benchmarks/doctor_underflow_jax.py ;;
    jax-strict) part jax-strict 70 env XLA_FLAGS=--xla_allow_excess_precision=false "$PY" \
        benchmarks/doctor_underflow_jax.py ;;
    check) part check 570 "$PY" benchmarks/gpu_check.py --budget 540 --out "$OUT" ;;
    *) echo "unknown part $p (accepted: env tests overhead doctor proofs quantize jax jax-strict check)"
        exit 2 ;;
    esac
done
