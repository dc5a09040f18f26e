#!/usr/bin/env bash
# README command one: train the hybrid and an attention-only control on a recall task beyond the window.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_env.sh
python scripts/demo.py "$@"
