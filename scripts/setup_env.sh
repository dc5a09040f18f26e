#!/usr/bin/env bash
# Creates .venv/ in the repo root with the pinned stack on first use, and reuses it after.
# Source it (`. scripts/setup_env.sh`): it leaves .venv/bin first on PATH.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo_root/.venv"
stamp="$venv/.hybrid-env-ready"
if [[ ! -f $stamp || $repo_root/pyproject.toml -nt $stamp ]]; then
  echo "Setting up $venv (first run: a few minutes) ..."
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$repo_root[dev]"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
