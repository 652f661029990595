#!/usr/bin/env bash
# Install gradcomp, then run the end-to-end demo (extra args go to `gradcomp demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
gradcomp demo "$@"
