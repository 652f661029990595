#!/usr/bin/env bash
# The prepared GPU call: every session lent a GPU runs it once and commits what it measured.
#
#   bash benchmarks/gpu_call.sh prepare [BASE]   # here: BASE's gradcomp and kernels (default:
#                                                # BEFORE below) into build/baseline
#   bash benchmarks/gpu_call.sh changed          # the methods whose code differs from it
#   device tool: run(command="bash benchmarks/gpu_call.sh run", carry=["build/baseline"], timeout_s=540)
#
# On the GPU machine, each step under its own timeout and the whole under DEADLINE seconds
# (about 8 minutes), everything written to $OUT as it is measured:
#   1. gradcomp installed (no dependencies: torch and triton stay as they are), `pytest -m cuda`
#      -> cuda_tests.txt
#   2. benchmarks/bench_gpu.py at 100M then 16M, every method, no cold start -> bench_gpu.json
#      (row by row: a timeout keeps every row measured before it)
#   3. the same script on build/baseline's package (BASE's kernels), 100M, the methods whose kernels
#      changed since BASE -> bench_gpu_before.json, and both side by side -> compare.txt
#   4. Nsight Compute on the rows below their targets, worst first, while time is left -> ncu.txt
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=2dc465f  # main before the redesigns of the top-k, sign/int4 decode and PowerSGD kernels
DEADLINE=${DEADLINE:-470}
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
    local methods="" family
    for family in quant sign topk powersgd; do
        if ! cmp -s "kernels/$family.py" "$BASELINE/gradcomp/kernels/$family.py" \
            || ! cmp -s "gradcomp/methods/$family.py" "$BASELINE/gradcomp/methods/$family.py"; then
            case $family in quant) methods+="int8,int4,";; *) methods+="$family,";; esac
        fi
    done
    echo "${methods%,}"
}

run() {
    : "${OUT:?run this on the device machine (OUT is where results go)}"
    export PYTHONUNBUFFERED=1
    left() { echo $(( DEADLINE - SECONDS )); }
    budget() {  # seconds for a step: at most $1, leaving $2 for the steps after it (at least 20)
        local s=$(( $(left) - $2 )); s=$(( s > $1 ? $1 : s )); echo $(( s < 20 ? 20 : s ))
    }
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$OUT/device.txt"

    echo "== 1. install, CUDA tests"
    python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
    timeout 130 python -m pytest -m cuda tests -q -p no:cacheprovider -x 2>&1 | tail -40 > "$OUT/cuda_tests.txt"
    tail -3 "$OUT/cuda_tests.txt"

    echo "== 2. bench_gpu (after), $(left) s left"
    timeout "$(budget 210 120)" python benchmarks/bench_gpu.py --sizes 100M,16M \
        --no-cold-start --json "$OUT/bench_gpu.json" 2>&1 | tail -45

    local methods
    methods=$(changed_methods)
    if [ -d "$BASELINE" ] && [ -n "$methods" ]; then
        echo "== 3. bench_gpu (before: $(cat "$BASELINE/COMMIT")) for $methods, $(left) s left"
        export BASELINE  # on PYTHONPATH, ahead of the editable install (and not behind the cwd: -P)
        PYTHONPATH=$BASELINE python -P -c "import gradcomp, os, sys; sys.exit('baseline not imported: ' + gradcomp.__file__) if not gradcomp.__file__.startswith(os.environ['BASELINE']) else None" || exit 1
        PYTHONPATH=$BASELINE timeout "$(budget 100 80)" python benchmarks/bench_gpu.py \
            --sizes 100M --methods "$methods" --no-cold-start --json "$OUT/bench_gpu_before.json" 2>&1 | tail -5
        python benchmarks/bench_gpu.py --compare "$OUT/bench_gpu_before.json" "$OUT/bench_gpu.json" | tee "$OUT/compare.txt"
    fi

    echo "== 4. ncu on the rows below target, $(left) s left"
    local ncu spec
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this machine"; return 0; }
    python benchmarks/bench_gpu.py --below-target "$OUT/bench_gpu.json" > "$OUT/below_target.txt"
    while IFS= read -r spec; do
        [ "$(left)" -gt 50 ] || { echo "out of time before $spec"; break; }
        echo "=== $spec" | tee -a "$OUT/ncu.txt"
        timeout 45 "$ncu" --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section WarpStateStats --section SchedulerStats \
            python benchmarks/bench_gpu.py --profile "$spec" 2>&1 | grep -v "^==PROF==" >> "$OUT/ncu.txt"
    done < "$OUT/below_target.txt"
    echo "done in $SECONDS s"
}

case ${1:-} in
    prepare) shift; prepare "$@" ;;
    changed) changed_methods ;;
    run) run ;;
    *) echo "usage: $0 prepare [BASE] | changed | run" >&2; exit 2 ;;
esac
