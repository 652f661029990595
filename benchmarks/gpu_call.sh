#!/usr/bin/env bash
# The prepared GPU call: every session lent a GPU runs it once and commits what it measured.
#
#   bash benchmarks/gpu_call.sh prepare [BASE]   # here: BASE's gradcomp and kernels (default:
#                                                # BEFORE below) into build/baseline
#   bash benchmarks/gpu_call.sh changed          # the methods whose code differs from it
#   device tool: run(command="bash benchmarks/gpu_call.sh run", carry=["build/baseline"], timeout_s=540)
#   DRY=1 OUT=$(mktemp -d) bash benchmarks/gpu_call.sh run   # here, no GPU: every step's command
#                                                # runs up to its CUDA check (arguments parsed, the
#                                                # CUDA tests collected), nothing installed
#
# On the GPU machine, each step under its own timeout and the whole under DEADLINE seconds
# (about 8.5 minutes), everything written to $OUT as it is measured:
#   0. prerequisites: the device and its name, torch/triton, gradcomp installed offline (no
#      dependencies: torch and triton stay as they are) -> device.txt
#   1. benchmarks/bench_gpu.py at 100M then 16M, the redesigned kernels (top-k, sign, PowerSGD,
#      int4) first (top-k's compress and decode rows: its compress is a new form, never measured;
#      then sign's decode rows), their decodes also as the hooks lay payloads out, no cold start ->
#      bench_gpu.json (row by row: a timeout keeps every row measured before it)
#   2. per-kernel CUDA times from torch.profiler (no counter permissions needed) of the rows in
#      KERNEL_ROWS -> kernel_times.txt
#   3. `pytest -m cuda`, every failure reported (no -x) -> cuda_tests.txt
#   4. the same benchmark on build/baseline's package (BASE's kernels), 100M, the methods whose
#      kernels changed since BASE -> bench_gpu_before.json, and both side by side -> compare.txt
#   5. Nsight Compute on the (at most 8) rows furthest below their targets, while time is left and
#      only where it can read the counters -> ncu.txt (at most 8 files come back from $OUT: this
#      script writes 8, so tee nothing else there)
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=2dc465f  # main before the redesigns of the top-k, sign/int4 decode and PowerSGD kernels
DEADLINE=${DEADLINE:-500}
BASELINE=${BASELINE:-$PWD/build/baseline}  # where prepare puts the "before" package

prepare() {
    local base=${1:-$BEFORE}
    rm -rf "$BASELINE" && mkdir -p "$BASELINE" || exit 1
    git archive "$base" gradcomp kernels | tar -x -C "$BASELINE" || exit 1
    mv "$BASELINE/kernels" "$BASELINE/gradcomp/kernels"  # as the installed package maps it
    git rev-parse "$base" > "$BASELINE/COMMIT"
    echo "$BASELINE: gradcomp at $(cat "$BASELINE/COMMIT") ($(du -sh "$BASELINE" | cut -f1)); carry it"
}

changed_methods() {  # the benchmarked methods whose kernels or method differ from the baseline's
    local methods="" family  # sign first, then top-k: their decodes are the latest redesigns
    for family in sign topk quant powersgd; do
        if ! cmp -s "kernels/$family.py" "$BASELINE/gradcomp/kernels/$family.py" \
            || ! cmp -s "gradcomp/methods/$family.py" "$BASELINE/gradcomp/methods/$family.py"; then
            case $family in quant) methods+="int8,int4,";; *) methods+="$family,";; esac
        fi
    done
    echo "${methods%,}"
}

KERNEL_ROWS="topk/compress+EF/100000000;sign/decode-sum p=64/100000000;sign/decode-sum p=64 hook-layout/100000000;topk/decode-sum p=64/100000000;int4/decode-sum p=64/100000000;int4/decode-sum p=64 hook-layout/100000000;powersgd/hook/100000000"
METHODS_FIRST=topk,sign,powersgd,int4,int8,fp16,bf16  # the redesigned kernels first, the latest (top-k's compress, then sign's decode) before them
# (bench_gpu measures a method's compress row before its decode rows: top-k's compress, the form
# the roofline predicts at 0.83-0.89 of a copy and no GPU has run, is the first row measured and
# the first row of the per-kernel times; top-k's decodes follow it, then sign's rows)

run() {
    : "${OUT:?run this on the device machine (OUT is where results go)}"
    export PYTHONUNBUFFERED=1
    left() { echo $(( DEADLINE - SECONDS )); }
    budget() {  # seconds for a step: at most $1, leaving $2 for the steps after it (at least 20)
        local s=$(( $(left) - $2 )); s=$(( s > $1 ? $1 : s )); echo $(( s < 20 ? 20 : s ))
    }
    local dry=${DRY:-0} collect=""
    echo "== 0. prerequisites"
    if [ "$dry" = 1 ]; then
        echo "dry run: no GPU expected, nothing installed" | tee "$OUT/device.txt"
        collect="--collect-only"
    else
        nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/device.txt" || exit 1
        python -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
            | tee -a "$OUT/device.txt" || exit 1
        python -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
    fi
    local ncu ncu_ok=0
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    if [ -n "$ncu" ] && timeout 60 "$ncu" --metrics sm__cycles_elapsed.avg python -c \
            "import torch; torch.ones(1, device='cuda').add_(1); torch.cuda.synchronize()" 2>&1 \
            | grep -q "sm__cycles_elapsed.avg"; then
        ncu_ok=1
    fi
    echo "ncu reads hardware counters: $ncu_ok (${ncu:-no ncu})" | tee -a "$OUT/device.txt"

    echo "== 1. bench_gpu (after), redesigned kernels first, $(left) s left"
    timeout "$(budget 230 230)" python benchmarks/bench_gpu.py --sizes 100M,16M --methods "$METHODS_FIRST" \
        --no-cold-start --json "$OUT/bench_gpu.json" 2>&1 | tail -60

    echo "== 2. per-kernel CUDA times (torch.profiler), $(left) s left"
    timeout "$(budget 70 160)" python benchmarks/bench_gpu.py --kernel-times "$KERNEL_ROWS" 2>&1 | tee "$OUT/kernel_times.txt" | tail -80

    echo "== 3. CUDA tests (every failure, none stops the rest), $(left) s left"
    timeout "$(budget 130 60)" python -m pytest -m cuda tests -q -p no:cacheprovider -n 4 --timeout 90 $collect \
        2>&1 | tail -60 > "$OUT/cuda_tests.txt"
    tail -15 "$OUT/cuda_tests.txt"

    local methods
    methods=$(changed_methods)
    if [ -d "$BASELINE" ] && [ -n "$methods" ] && [ "$(left)" -gt 60 ]; then
        echo "== 4. bench_gpu (before: $(cat "$BASELINE/COMMIT")) for $methods, $(left) s left"
        export BASELINE  # on PYTHONPATH, ahead of the editable install (and not behind the cwd: -P)
        PYTHONPATH=$BASELINE python -P -c "import gradcomp, os, sys; sys.exit('baseline not imported: ' + gradcomp.__file__) if not gradcomp.__file__.startswith(os.environ['BASELINE']) else None" || exit 1
        PYTHONPATH=$BASELINE timeout "$(budget 100 20)" python benchmarks/bench_gpu.py \
            --sizes 100M --methods "$methods" --no-cold-start --json "$OUT/bench_gpu_before.json" 2>&1 | tail -5
        if [ -f "$OUT/bench_gpu_before.json" ] && [ -f "$OUT/bench_gpu.json" ]; then
            python benchmarks/bench_gpu.py --compare "$OUT/bench_gpu_before.json" "$OUT/bench_gpu.json" | tee "$OUT/compare.txt"
        else
            echo "no comparison: a benchmark wrote no JSON" | tee "$OUT/compare.txt"
        fi
    fi

    echo "== 5. ncu on the rows below target, if it can read counters, $(left) s left"
    [ "$ncu_ok" = 1 ] || { echo "skipped: ncu cannot read counters here"; echo "done in $SECONDS s"; return 0; }
    local spec
    local below
    below=$(mktemp)  # not under $OUT: at most 8 files come back
    python benchmarks/bench_gpu.py --below-target "$OUT/bench_gpu.json" | head -8 > "$below"
    while IFS= read -r spec; do
        [ "$(left)" -gt 50 ] || { echo "out of time before $spec"; break; }
        echo "=== $spec" | tee -a "$OUT/ncu.txt"
        timeout 45 "$ncu" --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section Occupancy --section LaunchStats --section WarpStateStats \
            python benchmarks/bench_gpu.py --profile "$spec" 2>&1 | grep -v "^==PROF==" >> "$OUT/ncu.txt"
    done < "$below"
    echo "done in $SECONDS s"
}

case ${1:-} in
    prepare) shift; prepare "$@" ;;
    changed) changed_methods ;;
    run) run ;;
    *) echo "usage: $0 prepare [BASE] | changed | run" >&2; exit 2 ;;
esac
