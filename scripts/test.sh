#!/usr/bin/env bash
# Install gradcomp with its test extras (CPU torch first, so pip never pulls a CUDA build),
# then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "running pip as the 'root'" || true
python -m pip install -q -e ".[dev,data]" 2>&1 | grep -v "running pip as the 'root'" || true
python -m pytest -q -p no:cacheprovider "$@"
