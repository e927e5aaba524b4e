#!/bin/bash
# The bridge on a real accelerator: run from a clean copy of the repository on a machine whose JAX
# has a GPU (or TPU) plugin and whose torch may differ from the pinned one (the C++ extension is built
# against whatever torch is installed). Writes its log (and compile_gpu.md) to $OUT (default ./out).
#
#   git archive HEAD | tar -x -C /tmp/tb && OUT=/tmp/out bash /tmp/tb/scripts/device_check.sh
#
# Steps, each under its own time limit so one slow step cannot hide the others: build and register
# the device, the per-op eager benchmark, the semantic / compile / HF-model tests (llama, bert) against
# CPU torch, and the compiled-mode benchmark with the torch arms on cuda.
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TORCHBRIDGE_CACHE=/tmp/tbcache
PY=${PYTHON:-python3}
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{
el start; nvidia-smi -L 2>/dev/null
$PY -c "import torch, jax, transformers; print(torch.__version__, jax.__version__, transformers.__version__, jax.devices())"
el build; timeout 150 $PY -c "import torchbridge, torch; m = getattr(torch, torchbridge.device_name()); print('device', m.get_device_name(), m.get_platform(), m.device_count())" 2>&1 | tail -30
el eager-bench; timeout 80 $PY bench/bench_eager_ops.py --iters 200 2>&1 | tail -8
el tests; timeout 170 $PY -m pytest -q --timeout 100 -p no:cacheprovider tests/device/test_semantics.py tests/compile/test_compile.py tests/device/test_hf_models.py -k "test_semantics or test_compile or llama or bert" 2>&1 | tail -25
el compile-bench; timeout 185 $PY bench/bench_compile.py --torch-device cuda --arms compiled,inductor,cpu,fused,eager --iters 5 --warmup 2 --write "$OUT/compile_gpu.md" 2>&1 | grep -v Warn | tail -16
el done
} 2>&1 | tee "$OUT/device_check.log"
