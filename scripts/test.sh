#!/usr/bin/env bash
# README command two: the test suite without the tests marked slow (creates .venv/ on first use). Extra arguments go
# to pytest after the default marker, so `./scripts/test.sh -m slow` runs the slow ones instead (CI runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
python -m pytest -q -m "not slow" "$@"
