#!/usr/bin/env bash
# Install gradcomp and its test extras, then run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
python -m pytest -q -p no:cacheprovider "$@"
