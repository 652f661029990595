#!/usr/bin/env bash
# Install gradcomp and its test extras, then run the whole test suite. With no arguments: every
# test not marked serial on 2 xdist workers, then the serial ones (they time real work) alone;
# the 15 slowest tests of each phase are printed. Arguments go to one plain pytest run instead.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q -p no:cacheprovider "$@"
fi
started=$(date +%s)
status=0
python -m pytest -q -p no:cacheprovider -n "${GRADCOMP_TEST_WORKERS:-2}" --dist loadgroup \
    -m "not serial" --durations=15 || status=$?
python -m pytest -q -p no:cacheprovider -m serial --durations=15 || status=$?
echo "test suite: $(( $(date +%s) - started )) s of pytest, exit status $status"
exit "$status"
