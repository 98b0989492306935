#!/usr/bin/env bash
# GPU validation in two steps, each usable alone and each sized to finish in <= 240 s on one H100/H200
# (a GPU machine here comes for ~15 minutes in all, start-up included):
#   tools/gpu_check.sh test  [COMMIT]   build (RLENGINE_REQUIRE_EXT=1: a failed build is fatal) + every
#                                       gpu-marked test, bf16 included, in 4 parallel pytest shards
#   tools/gpu_check.sh bench [COMMIT]   ceilings, decode sweep (Qwen3-0.6B shape, CUDA graphs, NVML),
#                                       paged decode at long contexts, fused MoE fwd+bwd vs torch._grouped_mm,
#                                       fused log-prob time and peak memory
#   tools/gpu_check.sh all   [COMMIT]   both (bench assumes the build of `test` or an earlier install)
# The tree on the GPU machine may have no .git: the commit comes from the argument, else $RLENGINE_COMMIT,
# else git, else "unknown"; it is stamped into every JSON written. Results land in $OUT (default
# bench/results/gpu): gpu_check_<step>.json holds the provenance (commit, GPU, driver, torch/triton) and one
# summary line per goal; the per-benchmark JSONs and junit XMLs sit next to it. Elapsed seconds are printed
# after every part, so a run cut off by the device budget still tells which part ate the time.
# Time estimate (H200, cold Triton cache): build ~75 s (7 CPU + 2 CUDA sources through ninja, sm_90 only);
# tests ~90 s wall (~60 Triton specialisations compiled across the shards, plus 4 GiB-scale int32-offset
# tests); bench ~200 s (five processes, ~25 Triton compiles, the MoE T=32768 fwd+bwd and the unfused
# 151,936-vocab log-prob being the largest single items). Each part has its own timeout below.
set -euo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-all}
COMMIT=${2:-${RLENGINE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}}
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export OUT COMMIT TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 RLENGINE_REQUIRE_EXT=1
T0=$(date +%s)
elapsed() { echo "[gpu_check $STEP] $1: $(( $(date +%s) - T0 )) s elapsed"; }
case "$STEP" in test|bench|all) ;; *) echo "usage: $0 test|bench|all [COMMIT]"; exit 2;; esac
echo "[gpu_check] step=$STEP commit=$COMMIT out=$OUT"
nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.mem,power.limit --format=csv | tee "$OUT/gpu.txt"
elapsed "nvidia-smi"

# Writes gpu_check_<step>.json (provenance + summary lines) and stamps the commit into every JSON in $OUT.
summarize() {
  python3 - "$1" <<'PY'
import glob, json, os, subprocess, sys, xml.etree.ElementTree as ET
step, out, commit = sys.argv[1], os.environ["OUT"], os.environ["COMMIT"]
def smi(q):
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
try:
    import torch, triton
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
except ImportError as exc:
    versions = {"error": str(exc)}
prov = {"commit": commit, "gpu": smi("name"), "driver": smi("driver_version"), **versions}
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
lines, goals = [], {}
if step == "test":
    for xml in sorted(glob.glob(os.path.join(out, "junit_*.xml"))):
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
        shard = os.path.basename(xml)[6:-4]
        goals[shard] = {**counts, "failed": bad}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        line = f"tests[{shard}]: {passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
        lines.append(line + (f"; failed: {', '.join(bad[:8])}" if bad else ""))
    for shard in json.load(open(os.path.join(out, "shards.json"))):
        if shard not in goals:
            lines.append(f"tests[{shard}]: NO RESULT (timed out or crashed before writing its junit XML)")
else:
    dec = load("decode.json")
    if dec:
        by_b = {r["b_act"]: r for r in dec["rows"]}
        if 1 in by_b:
            ms = by_b[1]["ms_per_step"]; goals["decode_ms_B1"] = ms
            lines.append(f"decode Qwen3-0.6B bf16 B_act=1: {ms:.3f} ms/step (goal < 1.0) {'OK' if ms < 1.0 else 'MISS'}")
        if 64 in by_b:
            f = by_b[64]["roofline_fraction"]; goals["decode_roofline_B64"] = f
            lines.append(f"decode B_act=64: {f:.2f} of the Eq. 5 bound of docs/METHOD.md (goal >= 0.70) {'OK' if f >= 0.70 else 'MISS'}")
        joules = {b: r.get("decode_j_per_token") for b, r in by_b.items() if r.get("decode_j_per_token")}
        goals["nvml_decode_j_per_token"] = joules
        lines.append("NVML decode energy: " + (", ".join(f"B_act={b}: {j:.4f} J/token" for b, j in joules.items())
                                               if joules else "none recorded (NVML unavailable? see the decode log)"))
    pdj = load("paged_decode.json")
    if pdj:
        longest = max(r["ctx"] for r in pdj["rows"])
        rs = [r for r in pdj["rows"] if r["provider"] == "triton" and r["ctx"] == longest and r.get("GB/s")]
        for r in rs:
            lines.append(f"paged decode ctx={longest} B={r['B_act']} S={r['S']}: {r['GB/s']:.0f} GB/s = "
                         f"{r['frac_of_copy_bw'] or float('nan'):.2f} of copy bandwidth (goal >= 0.85)")
        if rs and rs[0].get("frac_of_copy_bw") is not None:
            worst = min(r["frac_of_copy_bw"] for r in rs); goals["paged_decode_min_frac"] = worst
            lines.append(f"paged decode long-context worst fraction {worst:.2f} {'OK' if worst >= 0.85 else 'MISS'}")
    moe = load("bench_moe.json")
    if moe:
        rs = [r for r in moe["rows"] if r["provider"] == "triton" and r.get("mode") == "fwd+bwd" and r.get("tflops")]
        if rs:
            r = max(rs, key=lambda r: r["T"]); ratio = r.get("vs_grouped_mm"); goals["moe_vs_grouped_mm"] = ratio
            lines.append(f"fused MoE fwd+bwd T={r['T']}: {r['tflops']:.0f} TFLOP/s, "
                         + (f"{ratio:.2f}x torch._grouped_mm (goal >= 1.2) {'OK' if ratio >= 1.2 else 'MISS'}"
                            if ratio else "no torch._grouped_mm baseline (see its skipped row)"))
    lp = load("bench_logprob.json")
    if lp:
        rs = [r for r in lp["rows"] if r["provider"] == "fused" and r["mode"] == "fwd+bwd" and r["entropy"]]
        for r in rs:
            ratio = r.get("mem_ratio"); goals["logprob_mem_ratio"] = ratio
            lines.append(f"fused log-prob fwd+bwd T={r['T']} V={r['V']}: {r['ms']:.1f} ms, peak {r['peak_extra_mb']:.0f}"
                         f" MiB, {ratio:.1f}x less than materialised logits (goal >= 8) {'OK' if ratio >= 8 else 'MISS'}"
                         if ratio else f"fused log-prob: no memory ratio ({r})")
    missing = [n for n in ("ceilings", "decode", "paged_decode", "bench_moe", "bench_logprob") if not load(n + ".json")]
    if missing:
        lines.append(f"no result from: {', '.join(missing)} (timed out or failed: see the log)")
for path in glob.glob(os.path.join(out, "*.json")):  # the tree may have no .git: stamp the commit
    try:
        data = json.load(open(path))
    except ValueError:
        continue
    cond = data.get("conditions") if isinstance(data, dict) else None
    if isinstance(cond, dict) and not cond.get("commit"):
        cond.update(commit=commit, commit_source="tools/gpu_check.sh")
        json.dump(data, open(path, "w"), indent=2)
elapsed = json.load(open(os.path.join(out, f"elapsed_{step}.json"))) if os.path.exists(
    os.path.join(out, f"elapsed_{step}.json")) else {}
json.dump({"step": step, "conditions": prov, "elapsed_s": elapsed, "summary": lines, "goals": goals},
          open(os.path.join(out, f"gpu_check_{step}.json"), "w"), indent=2)
print("\n".join(f"SUMMARY {line}" for line in lines))
PY
}
record() { python3 -c "import json,os,sys; p=os.path.join(os.environ['OUT'],'elapsed_'+sys.argv[1]+'.json'); \
d=json.load(open(p)) if os.path.exists(p) else {}; d[sys.argv[2]]=int(sys.argv[3]); json.dump(d,open(p,'w'))" \
  "$1" "$2" "$(( $(date +%s) - T0 ))"; }

run_test_step() {
  rm -f "$OUT"/junit_*.xml "$OUT/elapsed_test.json"
  CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CAP} MAX_JOBS=${MAX_JOBS:-$(nproc)}
  command -v ninja >/dev/null || echo "[gpu_check] WARNING: no ninja: the extensions compile one file at a time"
  # --no-deps: the device machine reaches no package index; its image holds torch, triton, transformers,
  # safetensors, tokenizers, rich, nvidia-ml-py and pytest. RLENGINE_REQUIRE_EXT=1 makes a failed build fatal.
  timeout 150 python3 -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -30
  python3 -c "import rlengine._ext as e; print('\n'.join(e.status_lines())); assert e.AVAILABLE and e.CUDA_AVAILABLE, \
'both extensions must load on the GPU machine'"
  elapsed "build"; record test build
  # Four shards in parallel: Triton compiles are single-threaded per process and dominate the wall time.
  python3 -c "import json,os; json.dump(['paged_decode','kernels','engine','others'], \
open(os.path.join(os.environ['OUT'],'shards.json'),'w'))"
  shard() { local name=$1; shift
    timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/junit_$name.xml" "$@" \
      > "$OUT/tests_$name.log" 2>&1; }
  shard paged_decode tests/gpu/test_triton_kernels_gpu.py -k paged_decode & local p1=$!
  shard kernels tests/gpu/test_triton_kernels_gpu.py -k "not paged_decode" & local p2=$!
  shard engine tests/gpu/test_model_and_engine_gpu.py & local p3=$!
  shard others tests/gpu --ignore=tests/gpu/test_model_and_engine_gpu.py \
    --ignore=tests/gpu/test_triton_kernels_gpu.py & local p4=$!
  local status=0 name pid rc
  for pair in paged_decode:$p1 kernels:$p2 engine:$p3 others:$p4; do
    name=${pair%%:*}; pid=${pair##*:}; rc=0
    wait "$pid" || rc=$?
    echo "[gpu_check] shard $name: exit status $rc$( [ "$rc" -eq 124 ] && echo ' (timed out)')"
    tail -3 "$OUT/tests_$name.log"
    [ "$rc" -eq 0 ] || status=1
  done
  elapsed "tests"; record test tests
  summarize test
  echo "[gpu_check] test step exit status: $status"
  return "$status"
}

run_bench_step() {
  rm -f "$OUT/elapsed_bench.json"
  timeout 40 python3 -m rlengine.cli bench ceilings --device cuda --out "$OUT" || echo "[gpu_check] ceilings failed"
  elapsed "ceilings"; record bench ceilings
  CEIL=(); [ -f "$OUT/ceilings.json" ] && CEIL=(--ceilings "$OUT/ceilings.json")
  timeout 75 python3 -m rlengine.cli bench decode --model qwen3-0.6b --dtype bfloat16 --batches 1,64 --no-hf \
    --gen-len 32 --reps 3 "${CEIL[@]}" --out "$OUT" --name decode || echo "[gpu_check] decode bench failed"
  elapsed "decode"; record bench decode
  timeout 45 python3 bench/bench_paged_decode.py --grid "B=1,8,64 ctx=4096,32768" "${CEIL[@]}" --out "$OUT" \
    || echo "[gpu_check] paged decode bench failed"
  elapsed "paged_decode"; record bench paged_decode
  timeout 70 python3 bench/bench_moe.py --grid "T=4096,32768" "${CEIL[@]}" --out "$OUT" || echo "[gpu_check] moe bench failed"
  elapsed "moe"; record bench moe
  timeout 45 python3 bench/bench_logprob.py "${CEIL[@]}" --out "$OUT" || echo "[gpu_check] logprob bench failed"
  elapsed "logprob"; record bench logprob
  summarize bench
}

trap 'echo "[gpu_check] exit status: $?"' EXIT
status=0
if [ "$STEP" = test ] || [ "$STEP" = all ]; then run_test_step || status=$?; fi
if [ "$STEP" = bench ] || [ "$STEP" = all ]; then T0=$(date +%s); run_bench_step || status=$?; fi
exit $status
