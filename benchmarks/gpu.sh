#!/usr/bin/env bash
# #28 item 5: fit.py on a lent GPU, in one command of the `device` tool (about 6 minutes).
#
# The device image has JAX with CUDA, flax, optax and orbax but no tensorboardX, and reaches no
# package index, so the wheels travel with the working tree (ignored by git, named in `carry`).
# Prepare them here first, in the repo's root:
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl/tbx tensorboardX==2.6.5
#   pip download ... -d .whl/pin flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8
#   git show b603621:fit.py > .whl/fit_b603621.py      # fit before #28, measured as fit_before
# then run `bash benchmarks/gpu.sh` there with carry [".whl"]. It smoke-tests a tiny fit() on
# the image's own flax, optax and orbax; if that fails, on the versions requirements.txt pins
# (.whl/pin); then runs `bench.py --accelerator` (the dispatch test, then hand, fit, fit_cond
# and fit_before); with NULL=1, first the null-model table of #49 (`bench.py --null`). Everything
# lands in $OUT.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} TF_CPP_MIN_LOG_LEVEL=2
# The orchestrator holds a JAX client while each run's own process has one: leave room for both.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
py=${PY:-python3}
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tbx .whl/tbx/*.whl || exit 1
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pin .whl/pin/*.whl || exit 1
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $py -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda.*|flax|optax|orbax-checkpoint|numpy|tqdm|tensorstore) "
  nproc; } | tee "$OUT/gpu.txt"

smoke() {  # a tiny fit() on the GPU: 2 epochs, a checkpoint, the metrics back
    $py - <<'EOF'
import os, tempfile, jax, numpy as np, optax, flax.linen as nn
import fit
assert jax.devices()[0].platform == os.environ.get("EXPECT_PLATFORM", "gpu"), jax.devices()
class M(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))
x = np.random.default_rng(0).normal(size=(256, 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
model = M()
state = fit.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x[:1])["params"],
                              tx=optax.adam(1e-2))
loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
state, history = fit.fit(state, (x, y), (x, y), loss_fn=loss, num_epochs=2, batch_size=32,
                         workdir=tempfile.mkdtemp())
print("smoke ok:", {k: v for k, v in history.timing.items() if k in ("steps", "compile_s")},
      jax.__version__, jax.devices())
EOF
}
export PYTHONPATH=/tmp/tbx
if smoke > "$OUT/smoke.log" 2>&1; then
    echo "versions: the image's own flax, optax and orbax" | tee -a "$OUT/gpu.txt"
else
    tail -n 15 "$OUT/smoke.log"
    export PYTHONPATH=/tmp/tbx:/tmp/pin
    smoke > "$OUT/smoke-pinned.log" 2>&1 || { tail -n 30 "$OUT/smoke-pinned.log"; exit 1; }
    echo "versions: flax, optax and orbax pinned as requirements.txt (.whl/pin)" | tee -a "$OUT/gpu.txt"
fi
tail -n 1 "$OUT"/smoke*.log
if [ -n "${NULL:-}" ]; then  # #49: NULL=1 runs the null-model table first (`bench.py --null`)
    timeout "${NULL_TIMEOUT:-240}" $py benchmarks/bench.py --null --repeats 3 --null-steps \
        "${NULL_STEPS:-10000}" --out "$OUT" 2>&1 | tee "$OUT/null.log" | grep -v "^  null"
fi
timeout "${BENCH_TIMEOUT:-360}" $py benchmarks/bench.py --accelerator --repeats 3 \
    --before .whl/fit_b603621.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^  accel"
rc=${PIPESTATUS[0]}
echo "bench exit: $rc"
[ "$rc" = 0 ] || cat "$OUT"/accelerator*.md  # cut short: the table of the runs it finished
