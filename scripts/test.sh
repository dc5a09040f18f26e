#!/usr/bin/env bash
# README command two: the test suite (creates .venv/ on first use). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
python -m pytest -q "$@"
