#!/usr/bin/env bash
# The GPU check, in one call of at most 8 minutes, with no network. The whole job first:
#   1. environment report (nvidia-smi, python, torch/CUDA, library versions) and an offline
#      install: wheels carried in .whl/ (if any), then this repo (`pip install --no-deps -e .`);
#   2. the job, bf16, random weights: scripts/bench.py on a 0.5B shape (a 55M one when less
#      than 300 s are left), whole processes, batchgen with an empty compile cache (cold)
#      against transformers' sorted generate; then batchgen again on the same cache (warm).
#      The summary gives the ratio, compile_s / capture_s cold and warm, the cache's hit,
#      MBU, the host's time between steps (host_gap_s p50) and compiled_token_share;
#   3. the GPU-marked tests (`pytest -m gpu`: CUDA graphs and no recompiles, NVML stats,
#      bf16 agreement with transformers, quantized paths, penalties on the device), and with 2+ GPUs tensor
#      parallelism at TP=2 (the summary says plainly when the device has one GPU);
#   4. the CUDA decode path, FlexAttention reading the paged pool in place: its GPU tests
#      against the gather path (tests/test_gpu_flex.py), then one layer's decode attention both
#      ways at 8B-like shapes (scripts/bench_paged_decode.py: ms, GB/s, outputs compared).
# Every step runs under `timeout`, none past the overall budget; a step that fails or
# times out is recorded and the next one still runs.
#
#   bash scripts/gpu_check.sh            # writes under $OUT if set, else ./gpu-out
#   GPU_CHECK_BUDGET=480 bash scripts/gpu_check.sh
#   GPU_CHECK_STEPS="setup bench" bash scripts/gpu_check.sh   # only some steps (a rerun)
#   GPU_CHECK_BENCH_MODEL=llama-55m bash scripts/gpu_check.sh  # the small shape
#   GPU_CHECK_STEPS="setup flex" bash scripts/gpu_check.sh    # the decode path alone (~3 min)
#
# Files written (8, flat, within what the device tool brings back): summary.md (steps,
# timings, test results, benchmark tables), setup.log, tests.log, flex.{log,json},
# bench.{log,json}, bench-warm.json.
# docs/benchmarks.md says how to prepare .whl/ and call this.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT="${OUT:-$REPO/gpu-out}"
mkdir -p "$OUT"
BUDGET="${GPU_CHECK_BUDGET:-470}" # seconds for all steps together (8 minutes, less start-up)
PY="${PYTHON:-python3}"
TMP=$(mktemp -d) # scratch outside $OUT, which holds only the files listed above
export PY PYTHONUNBUFFERED=1
export BATCHGEN_BENCH_CACHE="${BATCHGEN_BENCH_CACHE:-/tmp/batchgen-bench}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
STEPS=" ${GPU_CHECK_STEPS:-setup bench tests flex} "
T0=$(date +%s)
SUMMARY="$OUT/summary.md"

selected() { [[ $STEPS == *" $1 "* ]]; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }

# step NAME MAX_SECONDS LOG CMD...: run CMD for at most MAX_SECONDS, never past the budget.
step() {
    local name=$1 want=$2 log=$3
    shift 3
    local limit start rc status
    limit=$(left)
    ((limit > want)) && limit=$want
    if ((limit < 30)); then
        echo "| $name | skipped: budget spent | 0 s |" >>"$SUMMARY"
        return 0
    fi
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    echo "| $name | $status | $(($(date +%s) - start)) s |" >>"$SUMMARY"
    return 0
}

{
    echo "# batchgen GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    dirty=$(git -C "$REPO" status --porcelain 2>/dev/null | grep -q . && echo ", uncommitted changes")
    echo "commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)$dirty; budget ${BUDGET} s"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit \
        --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
    echo
    echo "| step | result | time |"
    echo "| --- | --- | ---: |"
} >"$SUMMARY"

# ---------------------------------------------------------------- 1. environment + install
cat >"$TMP/setup.sh" <<'SETUP'
echo "## nvidia-smi"
nvidia-smi || echo "nvidia-smi failed"
echo "## host"
uname -a
echo "cpus $(nproc)"
free -g
df -h /tmp | tail -1
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "## carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
echo "## pip install --no-deps -e . (offline)"
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
    echo "editable install failed; the repo root on PYTHONPATH stands in for it"
"$PY" - <<'PYEOF'
import importlib, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          round(p.total_memory / 2**30, 1), "GiB")
for name in ("transformers", "triton", "torchao", "optimum.quanto", "pynvml", "pyarrow",
             "safetensors", "tokenizers", "accelerate", "pytest", "pytest_timeout", "batchgen"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", ""), getattr(m, "__file__", ""))
    except Exception as e:
        print(name, "MISSING:", type(e).__name__, e)
PYEOF
SETUP
selected setup && step "environment + offline install" 45 "$OUT/setup.log" bash "$TMP/setup.sh"

# ---------------------------------------------------------------- 2. the job, cold then warm
# The engine against transformers' sorted generate at batch 32 on a 0.5B shape (Qwen2.5-0.5B's,
# random weights), bf16, the mixed workload of 192 rows, one pair; batchgen's compile cache
# starts empty (cold: one compile of the model, then a CUDA graph per capture size), then a
# second batchgen process on the same cache (warm: loads the compiled artifacts). Measured on
# an H200 on 2026-12-04: sorted generate 93 s for 256 rows, a static graph 42 s to compile
# (before the one symbolic graph of engine/compiled_forward.py).
CACHE="$TMP/compile-cache"
BENCH_MODEL="${GPU_CHECK_BENCH_MODEL:-qwen-0.5b}"
if selected bench; then
    (($(left) < 300)) && BENCH_MODEL=llama-55m # time is short: the small shape
    TORCH_LOGS="${TORCH_LOGS:-recompiles}" step "job $BENCH_MODEL mixed, cold cache" \
        "${GPU_CHECK_BENCH_S:-230}" "$OUT/bench.log" \
        "$PY" scripts/bench.py --model "$BENCH_MODEL" --dtype bfloat16 --device cuda \
        --workload mixed --rows 192 --pairs 1 --baselines sorted:32 --workdir "$TMP/bench" \
        --batchgen-args "--compile-cache $CACHE" --out "$OUT/bench.json" --markdown "$TMP/bench.md"
    TORCH_LOGS="${TORCH_LOGS:-recompiles}" step "job $BENCH_MODEL mixed, warm cache" 90 \
        "$OUT/bench.log" \
        "$PY" scripts/bench.py --model "$BENCH_MODEL" --dtype bfloat16 --device cuda \
        --workload mixed --rows 192 --sweep-max-num-seqs 256 --workdir "$TMP/bench-warm" \
        --batchgen-args "--compile-cache $CACHE" --out "$OUT/bench-warm.json"
    # What each benchmark process printed (recompiles with their times, TORCH_LOGS), kept
    # even when a step ran out of time: the work folders are deleted at the end.
    for f in "$TMP"/bench/logs/*.log "$TMP"/bench-warm/logs/*.log; do
        [ -f "$f" ] || continue
        echo "=== $(basename "$f"): recompiles, then its last lines"
        grep -i "recompil" "$f" | head -n 40
        tail -n 15 "$f"
    done >>"$OUT/bench.log" 2>&1
fi

# ---------------------------------------------------------------- 3. GPU-marked tests
PYTEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_TIMEOUT=(--timeout="${GPU_CHECK_TEST_TIMEOUT:-100}")
# BATCHGEN_INSTAFAIL: each failure's traceback is printed when it happens (tests/conftest.py),
# so a step cut by its limit still shows why its failed tests failed.
selected tests && BATCHGEN_INSTAFAIL=1 step "pytest -m gpu" "${GPU_CHECK_TESTS_S:-180}" "$OUT/tests.log" \
    "$PY" -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" \
    ${GPU_CHECK_TESTS:-tests/test_gpu.py tests/test_quant.py tests/test_penalties.py}

# ---------------------------------------------------------------- 3b. tensor parallel
# TP=2 over NCCL, compiled (the CUDA graphs capture the all-reduces): only on 2+ GPUs.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if selected tests; then
    if ((NGPU >= 2)); then
        step "pytest tensor parallel (2 GPUs)" 90 "$OUT/tests.log" \
            "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" \
            tests/test_gpu_tensor_parallel.py
    else
        echo "| tensor parallel | not run: this device has $NGPU GPU, TP=2 needs 2 | 0 s |" >>"$SUMMARY"
    fi
fi

# ---------------------------------------------------------------- 4. flex decode
# Tests first (flex is CUDA's default path; each eager (rows, width) bucket compiles flex once),
# then the micro-benchmark: bf16, 8 KV heads of 128 dims, 4 query heads each (Llama 3 8B's
# attention), 16-token blocks scattered over the pool, 1k context, 32 and 256 rows.
selected flex && step "pytest -m gpu flex" 60 "$OUT/flex.log" \
    "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider "${PYTEST_TIMEOUT[@]}" tests/test_gpu_flex.py
selected flex && step "decode attention gather vs flex" 40 "$OUT/flex.log" \
    "$PY" scripts/bench_paged_decode.py --device cuda --dtype bfloat16 --rows 32,256 --ctx 1024 \
    --kv-heads 8 --head-dim 128 --q-per-kv 4 --block-size 16 --out "$OUT/flex.json"
# The flex kernel's options (model/attention/paged_flex.py FLEX_OPTIONS, empty until measured) against
# the gather, in GB/s: inductor's own choice, then num_warps / num_stages / BLOCK_N variants.
selected flex && step "flex kernel options sweep" 60 "$OUT/flex.log" \
    "$PY" scripts/bench_paged_decode.py --device cuda --dtype bfloat16 --rows 32,256 --ctx 1024 \
    --kv-heads 8 --head-dim 128 --q-per-kv 4 --block-size 16 --reps 10 --options \
    '[{}, {"num_warps": 4}, {"num_warps": 4, "num_stages": 2}, {"num_warps": 8, "num_stages": 2}]'

# ---------------------------------------------------------------- summary
{
    echo
    echo "tests: $(grep -E '^=+ .*(passed|failed|error|skipped).* in ' "$OUT/tests.log" 2>/dev/null | tail -1 | tr -d '=')"
    grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/tests.log" 2>/dev/null | sed 's/^/    /'
    if [ -f "$OUT/flex.log" ]; then
        echo
        echo "flex: $(grep -E '^=+ .*(passed|failed|error|skipped).* in ' "$OUT/flex.log" | tail -1 | tr -d '=')"
        grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/flex.log" | sed 's/^/    /'
        echo
        grep -E '^(decode attention of one layer|\| )' "$OUT/flex.log"
    fi
    "$PY" - "$OUT/bench.json" "$OUT/bench-warm.json" <<'PYEOF' 2>/dev/null
import json, sys
print("\n| batchgen run | compile_s | capture_s | compile cache | output tok/s | MBU | host gap p50 ms | compiled share |")
print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
for name, path in zip(("cold", "warm"), sys.argv[1:]):
    try:
        report = json.load(open(path))
    except (OSError, ValueError):
        print(f"| {name} | - | - | not run | - | - | - | - |")
        continue
    workloads = report.get("workloads", [])
    runs = [r for w in workloads for r in w.get("runs", []) if r.get("engine") == "batchgen"]
    runs = runs or [p for w in workloads for p in w.get("sweep", [])]
    for r in runs[:1]:
        s = r.get("stats", r)
        mbu, gap = s.get("mbu"), (s.get("host_gap_s") or {}).get("p50")
        share = s.get("compiled_token_share")
        print(f"| {name} | {s.get('compile_s', 0):.1f} | {s.get('capture_s', 0):.1f} | "
              f"{s.get('compile_cache')} | {s.get('output_tokens_per_s', s.get('out_tok_s', 0)):.0f} | "
              f"{'-' if mbu is None else f'{mbu:.1%}'} | {'-' if gap is None else f'{gap * 1e3:.2f}'} | "
              f"{'-' if share is None else f'{share:.2f}'} |")
PYEOF
    for md in "$TMP/bench.md"; do
        [ -f "$md" ] && {
            echo
            cat "$md"
        }
    done
    echo
    echo "total $(($(date +%s) - T0)) s of a ${BUDGET} s budget"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
        --format=csv 2>/dev/null
} >>"$SUMMARY"
rm -rf "$TMP"
cat "$SUMMARY"
