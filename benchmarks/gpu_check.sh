#!/usr/bin/env bash
# Everything in rltk that needs CUDA, checked in one run of at most ~8 minutes on one GPU (issue 34):
#
#   bash benchmarks/gpu_check.sh                 # results in $OUT (default benchmarks/results/gpu-check)
#   WHEELS=path/to/wheels bash benchmarks/gpu_check.sh   # first install these wheels (no index, no deps)
#
# Parts, each under its own `timeout` so one that hangs cannot eat the others' time:
#   0. install: the carried wheels (WHEELS, e.g. omegaconf where the image lacks it), then rltk from
#      this tree (pip install --no-deps --no-build-isolation -e .); prints GPU, driver, torch, Triton;
#   1. tests: the gpu-marked tests, then every kernel test (tests/kernels, the Triton-interpreter
#      cases included), junit XML in $OUT;
#   2. logprobs: benchmarks/logprobs.py --device cuda at N=16384 D=4096, V=151936 (Qwen2.5) and 151665
#      (its tokenizer's odd size), bf16 / fp32 / fp16: correctness of values and gradients against the
#      naive path, time against the bare matmul and naive, peak memory;
#   3. grpo: benchmarks/gpu_grpo_step.py, one GRPO update of a random-init Qwen2 with Qwen2.5-0.5B's
#      shapes on 64 x 512 tokens, fused op against naive;
#   4. sweep: forward and forward+backward times of a few Triton block configurations (bf16, V=151936);
#   5. peers (issue 47, item 3): benchmarks/grpo_head_loss.py at the issue's shapes (32768 x 896 x 151936 and
#      16384 x 3584 x 152064, bf16): rltk triton, naive, CCE, Liger; ms, TFLOPS = 8 N H V / time, peak, error;
#   6. trl (issue 47, item 4): benchmarks/step_vs_trl.py --device cuda --model-size 0.5B: rltk's GRPO step
#      against TRL's, 8 x 8 samples x 256 new tokens, bf16; step time and peak, rltk / TRL.
#   7. hopper (issue 59): the gpu-marked tests of the Hopper kernels (impl="triton-hopper": bf16/fp16/fp32,
#      atomic and deterministic, against float64 at the 2e-3 bar), then benchmarks/grpo_head_loss.py at the
#      issue's two shapes with the issue's columns: naive, the shipped triton kernels, the Hopper kernels
#      (autotuned on their first call; the chosen configs land in hopper.json) and their deterministic mode,
#      verl, CCE, Liger's chunked GRPO loss; the summary ends with the issue's table, new columns included.
#   8. hopper-grpo (issue 59, for the second run): gpu_grpo_step.py, one GRPO update of the 0.5B-shaped model
#      with the shipped kernels, the Hopper kernels and naive (bf16 weights).
# PARTS="tests" (default "tests logprobs grpo sweep") runs only those parts: a check of the code paths alone
# after the figures were taken. "gpu-tests" is the gpu-marked tests alone (no CPU interpreter tests beside).
#
# Issue 47 in one run of ~8 minutes (15 minutes of device time: start-up, this, one rerun in reserve):
#
#   WHEELS=.gpu-carry PARTS="gpu-tests peers trl grpo" BUDGET=480 bash benchmarks/gpu_check.sh
#
# Issue 59 in one run of at most 7 minutes (the rest of the 15 for start-up and a shorter rerun):
#
#   WHEELS=.gpu-carry PARTS="hopper" BUDGET=420 bash benchmarks/gpu_check.sh
#
# A rerun on the still-warm machine after tuning finds Triton's compiled kernels in TRITON_CACHE_DIR (default
# under benchmarks/results/, which the device keeps between calls), so it is shorter; the GRPO update with
# the Hopper kernels (part hopper-grpo) is for a session with more device time:
#
#   WHEELS=.gpu-carry PARTS="hopper" BUDGET=300 bash benchmarks/gpu_check.sh
#   WHEELS=.gpu-carry PARTS="hopper-grpo" BUDGET=200 bash benchmarks/gpu_check.sh
#
# .gpu-carry holds Python 3.12 wheels the image lacks (the machine reaches no registry), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .gpu-carry omegaconf==2.4.0 cut-cross-entropy==25.1.1 liger-kernel==0.8.5 trl==1.16.0 \
#       datasets dill multiprocess xxhash pyarrow
# (for issue 59, 2.8 MB in all:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .gpu-carry omegaconf==2.4.0 cut-cross-entropy==25.1.1 liger-kernel==0.8.5 verl==0.9.1
# without trl and the datasets stack; grpo_head_loss.py imports
# verl's kernel without verl's package __init__, which needs Ray and more: the kernel needs torch, Triton and
# packaging only. Checked on a CPU: it imports, then stops at its NVTX ranges, which need CUDA)
# (omegaconf for rltk; CCE and Liger are pure Python + Triton; TRL imports datasets, which needs the rest
# unless the image has them: pyarrow alone is ~40 MB of the 64 MiB a call carries, so leave out what the
# image has). The preflight below prints which of them import; a part whose packages are missing says so in
# its rows (peers: "skipped: not installed") or fails at once (trl), and the other parts still run.
# Every part appends to $OUT/log.txt; $OUT/summary.md gets the versions, each part's exit status and
# time, and the tables. At most 8 files land in $OUT (the device tool brings back no more).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu-check}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
SUMMARY="$OUT/summary.md"
: >"$LOG"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Triton's compiled kernels in the tree's ignored results folder: a rerun on the same machine skips the compiles
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/benchmarks/results/triton-cache}
PY=${PYTHON:-python3}
START=$(date +%s)
# Every part ends by START + BUDGET seconds whatever the others did (the device call's own limit is
# larger by the machine's start-up and the transfers).
DEADLINE=$((START + ${BUDGET:-440}))
PARTS=" ${PARTS:-tests logprobs grpo sweep} "
wanted() { [[ "$PARTS" == *" $1 "* ]]; }
TMP=$(mktemp -d)

# part NAME SECONDS CMD...: run CMD under `timeout` (its limit, cut to what is left before DEADLINE),
# its output into the log, one status line each.
part() {
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    local left=$((DEADLINE - t0 - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        echo "| $name | SKIPPED: the run's time budget is spent | 0 s |" >>"$TMP/parts"
        echo "=== part $name: skipped, the run's time budget is spent" | tee -a "$LOG"
        return
    fi
    echo "=== part $name (limit ${limit}s, at +$((t0 - START))s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    local verdict=ok
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="TIMED OUT after ${limit}s"
    [ "$rc" -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
    echo "| $name | $verdict | $(($(date +%s) - t0)) s |" >>"$TMP/parts"
    echo "=== part $name: $verdict in $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

: >"$TMP/parts"
if [ -n "${WHEELS:-}" ]; then
    part wheels 60 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$TMP/site" "$WHEELS"/*.whl
    export PYTHONPATH="$TMP/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Editable, so the tests and benchmarks run this tree; the entry points (rltk's builtins) come with it.
part install 90 $PY -m pip install -q --no-deps --no-build-isolation --no-compile -e .

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    timeout 120 $PY - <<'EOF' 2>&1
import platform, torch, triton, transformers
p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
print(f"device: {torch.cuda.get_device_name(0) if p else 'NO CUDA DEVICE'}"
      + (f", {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB" if p else ""))
import rltk
print(f"rltk {rltk.__version__} from {rltk.__file__}")
EOF
    echo '```'
} >>"$SUMMARY"
cat "$SUMMARY" | tee -a "$LOG"
# Which optional packages import here (the peers' and TRL's), so a skipped row is explained in the summary.
{
    echo '```'
    timeout 120 $PY - <<'EOF' 2>&1
import importlib
for name in ("omegaconf", "cut_cross_entropy", "liger_kernel", "trl", "datasets", "pyarrow", "pandas"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'imported')}")
    except Exception as err:
        print(f"{name}: MISSING ({type(err).__name__}: {err})")
EOF
    echo '```'
} >>"$SUMMARY"

# 1. tests. The kernel tests that need no GPU (CPU tensors, the Triton-interpreter cases: CPU-bound)
# run in the background on 4 of the CPUs while the GPU parts run; the gpu-marked tests run alone first,
# so their timing assertions have the GPU to themselves.
wanted tests && (
    LOG="$TMP/kernels.log" DEADLINE=$DEADLINE
    part tests-kernels 300 $PY -m pytest -p no:cacheprovider -q -rfE -n 4 -m "not gpu" tests/kernels \
        --junitxml="$OUT/tests-kernels.xml"
) &
KERNELS=$!
GPU_TESTS="tests/kernels tests/strategies/test_accelerate_strategy.py tests/rollout/test_hf.py tests/rollout/test_vllm_engine.py
    tests/rollout/test_vllm_lora.py tests/recipes/test_recipes_on_cuda.py"
wanted gpu-tests && part tests-gpu 200 $PY -m pytest -p no:cacheprovider -q -rA -m gpu $GPU_TESTS \
    --junitxml="$OUT/tests-gpu.xml"
wanted tests && part tests-gpu 300 $PY -m pytest -p no:cacheprovider -q -rA -m gpu $GPU_TESTS --junitxml="$OUT/tests-gpu.xml"

# 2. the fused op against naive and the bare matmul (~3 min on an H100 by the sizes; see docs/benchmarks.md)
wanted logprobs && part logprobs 240 $PY benchmarks/logprobs.py --device cuda --repeats 3 --n 16384 --d 4096 \
    --vocab 151936 151665 --dtypes bfloat16 float16 float32 --cases matmul triton naive \
    --out "$OUT/logprobs.json" --table "$TMP/logprobs.md"

# 3. a GRPO update step, fused against naive
wanted grpo && part grpo 110 $PY benchmarks/gpu_grpo_step.py --precisions bf16-weights amp-bf16 --steps 3 --micro-batch 16 \
    --out "$OUT/grpo.json" --table "$TMP/grpo.md"

# 4. Triton block sizes (data for tuning the default TritonConfig)
wanted sweep && part sweep 60 $PY benchmarks/logprobs.py --device cuda --triton-configs --repeats 3 --n 16384 --d 4096 \
    --vocab 151936 --dtypes bfloat16 --out "$OUT/sweep.json" --table "$TMP/sweep.md"

# 5. issue 47, item 3: the GRPO head loss against the peers at the issue's shapes (~2-3 min: the float64
# reference, Triton and torch.compile warm-ups, 2 warm-ups + 5 timed runs of each method)
wanted peers && part peers 240 $PY benchmarks/grpo_head_loss.py --device cuda --out "$OUT/peers.json" \
    --table "$TMP/peers.md"

# 6. issue 47, item 4: rltk's GRPO step against TRL's on a Qwen2.5-0.5B-shaped model (one round: rltk, then
# TRL, 4 steps each with the first left out; generation of 64 x 256 tokens dominates a step)
wanted trl && part trl 240 $PY benchmarks/step_vs_trl.py --device cuda --model-size 0.5B --rounds 1 --steps 4 \
    --threads 0 --out "$OUT/trl.json"
if wanted trl && [ -f "$OUT/trl.json" ]; then
    $PY - "$OUT/trl.json" >"$TMP/trl.md" 2>&1 <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["summary"]
print("| side | median step (s) | peak MiB | answer tokens |\n|---|---|---|---|")
for side in ("rltk", "trl"):
    print(f"| {side} | {s[side]['median_step_s']:.3f} | {s[side]['peak_mib']:.0f} | {s[side]['mean_answer_tokens']:.1f} |")
print(f"\nrltk / TRL: step {r['ratio_rltk_over_trl']:.2f}x, peak {r['peak_ratio_rltk_over_trl']:.2f}x; {r['versions']}")
EOF
fi

# 7. issue 59: the Hopper kernels' own GPU tests, then the issue's table (~4-5 min: Triton compiles the
# autotune's five candidates once for the first shape, the second reuses them; float64 reference; 2 warm-ups
# + 5 timed runs of each method)
wanted hopper && part hopper-tests 100 $PY -m pytest -p no:cacheprovider -q -rA -m gpu \
    tests/kernels/test_triton_hopper.py --junitxml="$OUT/tests-hopper.xml"
wanted hopper && part hopper 300 $PY benchmarks/grpo_head_loss.py --device cuda --methods naive rltk-triton \
    rltk-triton-hopper rltk-triton-hopper-det verl cce liger-grpo --out "$OUT/hopper.json" --table "$TMP/hopper.md"
wanted hopper-grpo && part hopper-grpo 150 $PY benchmarks/gpu_grpo_step.py --precisions bf16-weights \
    --impls triton triton-hopper naive --steps 3 --micro-batch 16 --out "$OUT/hopper-grpo.json" \
    --table "$TMP/hopper-grpo.md"

if wanted tests; then
    wait "$KERNELS"
    cat "$TMP/kernels.log" >>"$LOG"
    grep -E "^(FAILED|ERROR)|passed|failed" "$TMP/kernels.log" | tail -20
fi

{
    echo
    echo "| part | result | time |"
    echo "|---|---|---|"
    cat "$TMP/parts"
    for t in logprobs grpo sweep peers trl hopper hopper-grpo; do
        if [ -f "$TMP/$t.md" ]; then
            echo
            echo "## $t"
            echo
            cat "$TMP/$t.md"
        fi
    done
    echo
    echo "total $(($(date +%s) - START)) s"
} >>"$SUMMARY"
rm -rf "$TMP"
cat "$SUMMARY"
