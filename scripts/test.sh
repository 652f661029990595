#!/usr/bin/env bash
# Install gradcomp and its test extras, then run the whole test suite. With no arguments: every
# test not marked serial on 2 xdist workers, then the serial ones (they time real work) alone;
# the 15 slowest tests of each phase are printed. Arguments go to one plain pytest run instead.
#
# Nothing can hang: each test has TEST_TIMEOUT_S (pytest-timeout dumps every thread's stack and
# ends the worker), a crashed xdist worker fails the run at once naming its test
# (--max-worker-restart 0: a replaced worker can leave xdist's loadgroup scheduler waiting on
# nothing, pytest-dev/pytest-xdist#1378), and each phase has a wall limit.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
TEST_TIMEOUT_S=${GRADCOMP_TEST_TIMEOUT_S:-300}
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q -p no:cacheprovider --timeout "$TEST_TIMEOUT_S" --timeout-method thread "$@"
fi
started=$(date +%s)
status=0
phase() {  # phase WALL_S PYTEST_ARGS...: one pytest run, ended past WALL_S seconds (SIGTERM: every
    # pytest process prints its threads' stacks first, tests/conftest.py)
    local wall=$1
    shift
    timeout --kill-after=30 "$wall" python -m pytest -q -p no:cacheprovider \
        --timeout "$TEST_TIMEOUT_S" --timeout-method thread --durations=15 "$@" || {
        local rc=$?
        [ "$rc" -eq 124 ] && echo "test suite: a phase ran past its wall limit of $wall s" >&2
        return "$rc"
    }
}
phase "${GRADCOMP_PARALLEL_WALL_S:-1200}" -n "${GRADCOMP_TEST_WORKERS:-2}" --dist loadgroup \
    --max-worker-restart 0 -m "not serial" || status=$?
phase "${GRADCOMP_SERIAL_WALL_S:-400}" -m serial || status=$?
echo "test suite: $(( $(date +%s) - started )) s of pytest, exit status $status"
exit "$status"
