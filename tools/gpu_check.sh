#!/usr/bin/env bash
# One script for every GPU check: the gpu-marked tests (compiled Triton, no interpreter) and the
# GPU benchmarks, sized to finish in under 8 minutes on one H100/H200. Results land in $OUT
# (default bench/results/gpu) with the conditions; copy them into docs/RESULTS.md. Uses python3
# (on the device image that is the interpreter holding torch; a bare `python` may not exist).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit,driver_version --format=csv | tee "$OUT/gpu.txt"
# --no-deps: the device machine reaches no package index; its image already holds torch, triton,
# transformers, safetensors, tokenizers, rich, nvidia-ml-py and pytest (math-verify is imported lazily).
python3 -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -2
python3 -c "import rlengine._ext as e; print('C++ ops:', [op for op in e.CPP_OPS if e.has_op(op)])"
timeout 180 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log"
timeout 60 python3 -m rlengine.cli bench ceilings --device cuda --out "$OUT"
timeout 90 python3 bench/bench_paged_decode.py --full --out "$OUT"
timeout 120 python3 bench/bench_moe.py --out "$OUT"
timeout 60 python3 bench/bench_logprob.py --out "$OUT"
timeout 150 python3 -m rlengine.cli bench decode --model qwen3-0.6b --dtype bfloat16 --batches 1,8,64,256 --compare-eager --out "$OUT"
