#!/usr/bin/env bash
# GPU validation in two steps. A GPU machine comes for ~15 minutes in all (start-up ~35 s included), so
# both steps run in ONE device call, test first: the bench then reuses the test step's build. Measured on
# the first H200 run: build 113 s (16 cores), test shards 45-63 s side by side, bench parts 9-41 s each.
# The limits below keep test + bench <= 540 s, leaving ~5 minutes for a rerun of what failed; a bench on
# a fresh machine (its own build) stays <= 420 s.
#   tools/gpu_check.sh test  [COMMIT]   build (a failed build stops the step) + every gpu-marked test,
#                                       bf16 included, in 4 parallel pytest shards
#   tools/gpu_check.sh rl    [COMMIT]   the build if the machine has none (<= 150 s), then the training tests
#                                       (tests/gpu/test_training_gpu.py, 60 s), grpo_long on seed 0 (90 s, stopped
#                                       by SIGINT at an update boundary: J curve, generation share, update split),
#                                       the job's q over B_gen with the policy frozen (40 s), the asymmetry at the
#                                       Qwen3-0.6B shape (40 s) and the cost tables of tiny and Qwen3-0.6B (40 s):
#                                       <= 420 s in one device call
#   tools/gpu_check.sh profile [COMMIT] the build if the machine has none (<= 180 s), then the decode step
#                                       profiled (rlengine/benchmarks/decode_gpu_profile.py): per-kernel
#                                       table at B_act 1 and 64 with GPU busy vs wall and the graph-replay
#                                       trace check (90 s), CUDA-event times of replay, head, sampler and
#                                       step with async on and off (120 s), paged decode at B 1 and a 32K
#                                       context over splits and BLOCK_N (40 s): <= 430 s in one device call
#   tools/gpu_check.sh decode2 [COMMIT] the build if the machine has none (<= 180 s), then the fused decode
#                                       layer (gen.decode_kernels): its gpu-marked tests (greedy parity with
#                                       the torch path at B_act 1 and 64, 90 s), the decode step at B_act 1
#                                       and 64 with torch, then fused (Qwen3-0.6B shape, bf16, CUDA graphs,
#                                       45 s each), and the small-M GEMM configs measured per shape class
#                                       (60 s): <= 420 s; its summary says whether fused may become default
#   tools/gpu_check.sh bench [COMMIT]   the build if the machine has none, then ceilings, decode sweep
#                                       (Qwen3-0.6B shape, CUDA graphs, NVML), paged decode at long contexts,
#                                       fused MoE fwd+bwd vs torch._grouped_mm, fused log-prob time and memory,
#                                       shared-prefix (cascade) decode vs plain decode in Triton
# Results: every log, junit XML and bench JSON of a step is packed into $OUT/gpu_check_<step>.tar.gz, and
# $OUT/gpu_check_<step>.json holds the conditions (commit, GPU, driver, torch/triton), each part's exit
# status and seconds, one summary line per goal and the goals' values: two files per step ($OUT defaults
# to bench/results/gpu). The summary lines are the last lines printed, so they survive a truncated log.
# Each part has its own timeout (the sums above); a part that fails or times
# out costs its own result only, except the build, which stops the step.
# GPU_CHECK_DRY=1 runs the packing and the summary on a CPU with stand-in results (tests/tools);
# GPU_CHECK_DRY=build-fails also makes the build fail.
# The tree on the GPU machine may have no .git: the commit comes from the argument, else $RLENGINE_COMMIT,
# else git, else "unknown"; it is stamped into every JSON.
set -uo pipefail  # no -e: every part's exit status is checked where it runs
cd "$(dirname "$0")/.."
STEP=${1:-}
case "$STEP" in test|bench|rl|profile|decode2) ;; *) echo "usage: $0 test|bench|rl|profile|decode2 [COMMIT]"; exit 2;; esac
COMMIT=${2:-${RLENGINE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}}
OUT=${OUT:-bench/results/gpu}
DRY=${GPU_CHECK_DRY:-0}; [ "$DRY" = "" ] && DRY=0
WORK=$(mktemp -d)/gpu_check_$STEP
mkdir -p "$OUT" "$WORK"
export COMMIT TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 RLENGINE_REQUIRE_EXT=1
T0=$(date +%s)
STATUS=0
finish() { python3 tools/gpu_check_summary.py finish "$STEP" "$WORK" "$OUT" "$COMMIT" "$STATUS"; }
trap 'finish; rc=$?; exit $rc' EXIT  # finish's status: this step's, or 1 for any failed test or part
echo "[gpu_check] step=$STEP commit=$COMMIT out=$OUT work=$WORK dry=$DRY"

# part NAME LIMIT CMD...: run CMD with a timeout, its output in WORK/NAME.log, its status in WORK/part_NAME.json
part() {
  local name=$1 limit=$2 start rc; shift 2
  start=$(date +%s)
  # bash -c: CMD may be one of the functions below (exported), which timeout cannot run itself
  timeout -k 5 "$limit" bash -c '"$@"' _ "$@" > "$WORK/$name.log" 2>&1; rc=$?
  python3 tools/gpu_check_summary.py part "$STEP" "$WORK" "$name" "$rc" "$(( $(date +%s) - start ))" "$limit"
  echo "[gpu_check $STEP] $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)') after" \
       "$(( $(date +%s) - start )) s (limit $limit s); $(( $(date +%s) - T0 )) s since the start"
  tail -3 "$WORK/$name.log"
  return "$rc"
}

build() {
  if [ "$DRY" != 0 ]; then [ "$DRY" != build-fails ]; return; fi
  local cap; cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$cap} MAX_JOBS=${MAX_JOBS:-$(nproc)}
  command -v ninja >/dev/null || echo "[gpu_check] WARNING: no ninja: the extensions compile one file at a time"
  # --no-deps: the device machine reaches no package index; its image holds torch, triton, transformers,
  # safetensors, tokenizers, rich, nvidia-ml-py and pytest. RLENGINE_REQUIRE_EXT=1 makes a failed build fatal.
  python3 -m pip install --no-build-isolation --no-deps -v -e . && python3 -c "import rlengine.model.ext as e; \
print('\n'.join(e.status_lines())); assert e.AVAILABLE and e.CUDA_AVAILABLE, 'both extensions must load'"
}

gpu_info() {  # the card, driver and clocks of this machine, into the archive (not in a dry run)
  [ "$DRY" = 0 ] && nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.mem,power.limit \
    --format=csv | tee "$WORK/gpu.txt"
  return 0
}

standin() {  # standin STEP: a dry run's stand-in results for the step's parts
  [ "$DRY" != 0 ] && python3 tools/gpu_check_summary.py standin "$1" "$WORK"
  return 0
}

has_build() {
  [ "$DRY" != 0 ] && return 1
  python3 -c "import rlengine.model.ext as e; assert e.AVAILABLE and e.CUDA_AVAILABLE" >/dev/null 2>&1
}

build_or_stop() {  # a failed build ends the step: nothing after it could mean anything
  if ! part build "$1" build; then
    echo "[gpu_check $STEP] BUILD FAILED: stopping (build.log is in the archive)"
    STATUS=1; exit 1
  fi
}

shard() {  # shard NAME PYTEST-ARGS...
  local name=$1; shift
  if [ "$DRY" != 0 ]; then return 0; fi
  python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$WORK/junit_$name.xml" "$@"
}

run_test_step() {
  gpu_info
  build_or_stop 180
  standin test
  # Four shards in parallel: Triton compiles are single-threaded per process and dominate the wall time.
  part paged_decode 100 shard paged_decode tests/gpu/test_triton_kernels_gpu.py -k paged_decode & local p1=$!
  part kernels 100 shard kernels tests/gpu/test_triton_kernels_gpu.py -k "not paged_decode" & local p2=$!
  part engine 100 shard engine tests/gpu/test_model_and_engine_gpu.py & local p3=$!
  part others 100 shard others tests/gpu --ignore=tests/gpu/test_model_and_engine_gpu.py \
    --ignore=tests/gpu/test_triton_kernels_gpu.py & local p4=$!
  local pid
  for pid in $p1 $p2 $p3 $p4; do wait "$pid" || STATUS=1; done
}

bench() {  # bench NAME CMD...: a real bench, or its stand-in result in a dry run
  local name=$1; shift
  if [ "$DRY" != 0 ]; then return 0; fi
  "$@"
}

run_bench_step() {
  gpu_info
  has_build || build_or_stop 180  # a fresh machine: the test step's build is gone
  standin bench
  part ceilings 15 bench ceilings python3 -m rlengine.cli bench ceilings --device cuda --out "$WORK" || STATUS=1
  local ceil=(); [ -f "$WORK/ceilings.json" ] && ceil=(--ceilings "$WORK/ceilings.json")
  part shared_prefix 60 bench shared_prefix python3 bench/bench_shared_prefix.py --backend triton \
    --model qwen3-0.6b --dtype bfloat16 --cases grpo-512 --rounds 2 --iters 20 --out "$WORK" || STATUS=1
  part decode 50 bench decode python3 -m rlengine.cli bench decode --model qwen3-0.6b --dtype bfloat16 \
    --batches 1,64 --no-hf --gen-len 32 --reps 3 "${ceil[@]}" --out "$WORK" --name decode || STATUS=1
  part paged_decode 25 bench paged_decode python3 bench/bench_paged_decode.py --grid "B=1,8,64 ctx=4096,32768" \
    "${ceil[@]}" --out "$WORK" || STATUS=1
  part moe 35 bench moe python3 bench/bench_moe.py --grid "T=4096,32768" "${ceil[@]}" --out "$WORK" || STATUS=1
  part moe_breakdown 30 bench moe_breakdown python3 -m rlengine.cli bench moe --breakdown --grid "T=4096,32768" \
    --iters 5 "${ceil[@]}" --out "$WORK" || STATUS=1
  part logprob 20 bench logprob python3 bench/bench_logprob.py "${ceil[@]}" --out "$WORK" || STATUS=1
}

run_profile_step() {
  gpu_info
  has_build || build_or_stop 180
  standin profile
  local part_name limit
  for part_name in kernels:90 events:120 paged:40; do
    limit=${part_name#*:}; part_name=${part_name%%:*}
    part "profile_$part_name" "$limit" bench "profile_$part_name" \
      python3 -m rlengine.benchmarks.decode_gpu_profile "$part_name" --out "$WORK" || STATUS=1
  done
}

grpo_long() {  # the long-response job until SIGINT stops it at an update boundary (exit 130: a clean stop)
  python3 -m rlengine.cli train --config grpo_long --run.seed 0 --run.progress false --run.out_dir "$WORK/grpo_long"
  local rc=$?; [ "$rc" -eq 130 ] && return 0; return "$rc"
}

costs() {
  python3 -m rlengine.cli bench costs --model tiny --out "$WORK" && \
  python3 -m rlengine.cli bench costs --model qwen3-0.6b --dtype bfloat16 --out "$WORK"
}

run_decode2_step() {
  gpu_info
  has_build || build_or_stop 180
  standin decode2
  part fused_tests 90 shard fused_tests tests/engine/test_fused_decode_layer.py || STATUS=1
  local k
  for k in torch fused; do  # the same bench, one setting after the other on the same warm machine
    part "decode_$k" 45 bench "decode_$k" python3 -m rlengine.cli bench decode --model qwen3-0.6b \
      --dtype bfloat16 --batches 1,64 --no-hf --gen-len 32 --reps 3 --prefill-len 0 --no-plot \
      --decode-kernels "$k" --out "$WORK" --name "decode_$k" || STATUS=1
  done
  part small_m_tune 60 bench small_m_tune python3 -m rlengine.benchmarks.small_m_tune --seconds 45 \
    --out "$WORK" || STATUS=1
}

run_rl_step() {
  gpu_info
  has_build || build_or_stop 150
  standin rl
  part rl_tests 60 shard rl_tests tests/gpu/test_training_gpu.py || STATUS=1
  # SIGINT, not SIGTERM-then-KILL: the trainer finishes its update, checkpoints, and metrics.jsonl is whole
  local start; start=$(date +%s)
  if [ "$DRY" = 0 ]; then timeout -s INT -k 15 75 bash -c grpo_long > "$WORK/grpo_long.log" 2>&1; fi
  local rc=$?
  python3 tools/gpu_check_summary.py part rl "$WORK" grpo_long "$rc" "$(( $(date +%s) - start ))" 90
  [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || STATUS=1  # 124: stopped by the timeout's SIGINT, as intended
  part job_ladder 40 bench job_ladder python3 -m rlengine.cli bench job_ladder --config grpo_long \
    --b-gen 32,128,512,1024 --updates 6 --skip 2 --repeats 1 --out "$WORK" || STATUS=1
  part asymmetry 40 bench asymmetry python3 -m rlengine.cli bench asymmetry --model qwen3-0.6b --dtype bfloat16 \
    --device cuda --batches 8,32,64 --reps 1 --out "$WORK" || STATUS=1
  part costs 40 bench costs costs || STATUS=1
}

export DRY WORK STEP
export -f build shard bench grpo_long costs
case "$STEP" in test) run_test_step;; bench) run_bench_step;; rl) run_rl_step;; profile) run_profile_step;;
  decode2) run_decode2_step;; esac
