#!/usr/bin/env bash
# Everything that needs a GPU, in as few calls to the lent H200 as possible (each call: at most 10 minutes).
# Run from the repository root on the CUDA machine; logs and JSON go to $OUT (the device tool brings them back).
#
#   bash scripts/device_check.sh kernels   # kernel + model tests on the GPU, then bench_kernels.py's table
#   bash scripts/device_check.sh ssd       # Mamba-2's scan kernels and fused branch op: their tests and the model's
#                                          # on the GPU (one call: they take ~7 minutes on an H100)
#   bash scripts/device_check.sh ssd-bench # bench_kernels.py --only ssd,train (the scan, the training step of both
#                                          # branches against the model without the branch)
#   bash scripts/device_check.sh mamba2-prefill  # the kernels a served Mamba-2 prefill runs (conv, packed-prefill scan,
#                                          # gated norm): their tests, then bench_kernels.py's prefill rows at the
#                                          # serving benchmark's prefill step (one 8192-token sequence, E 2048) and at
#                                          # 8 x 1024; vLLM's Mamba-2 kernels beside ours where vLLM is staged;
#                                          # then the scan's launch-shape sweep and kernel split at 1 x 8192
#   bash scripts/device_check.sh mamba2-steps  # the Mamba-2 (N 128) training step against the model without the branch:
#                                          # eager with one profiled step, then under torch.compile (the scan's
#                                          # kernels traced into the step's graph)
#   bash scripts/device_check.sh sweep     # launch-configuration sweeps of every kernel (--only sweep,scan_sweep,
#                                          # then prefill_scan_sweep at the serving prefill shape)
#   bash scripts/device_check.sh vllm [K]  # the vLLM tests on the GPU (vLLM staged first: ../shared/gpu/stage-vllm);
#                                          # on the two-GPU kind (nvidia-h200-x2) this includes tensor parallel 2;
#                                          # K: a pytest -k expression. vLLM serves hybrids on its V1 model
#                                          # runner; `VLLM_USE_V2_MODEL_RUNNER=1 bash ... vllm` runs the same
#                                          # tests on Model Runner V2 (the engines inherit the environment)
#   bash scripts/device_check.sh steps [TREES]  # one SSM branch's host work and a decode step's (bench_host_work.py), then
#                                          # the training step against the same model with the SSM branch off
#                                          # (3 rounds, one profiled step; TREES: more trees beside this one, as
#                                          # bisect_train_step.py takes them) and generate() at the small shape
#                                          # against Mistral, static and dynamic caches
#   bash scripts/device_check.sh lm ARGS...  # scripts/bench_lm.py ARGS (the memory program's runs), results to $OUT
#                                          # (`--stage train`, then `--stage evaluate` in the next call of the
#                                          # lease: a run too long for one call; the trained model stays on
#                                          # the warm machine between them)
#   bash scripts/device_check.sh startup   # scripts/check_engine_start.py (vLLM staged): build, save and convert a
#                                          # ~1B model, then LLM() with vLLM's defaults in the same process, under a
#                                          # time limit (a hang fails it)
#   bash scripts/device_check.sh serving ARGS...   # scripts/bench_serving.py ARGS (vLLM staged), e.g.
#                                          # `serving --models hybrid --prefix` then `serving --models swa,llama`
#   bash scripts/device_check.sh both K ARGS...    # on the two-GPU kind, in one call: `vllm K` on GPU 0 (no TP 2)
#                                          # while `serving ARGS` runs on GPU 1
#   bash scripts/device_check.sh generate-ab BASE [ARGS]  # generate() at the small shape, static caches, of this tree
#                                          # and of the tree in folder BASE (made and carried as for `ab`), each tree's
#                                          # own bench_generate.py in turn, two rounds in ABBA order (ARGS go to each
#                                          # run, e.g. --models hybrid,hybrid-mamba2,swa)
#   bash scripts/device_check.sh serving-ab BASE ARGS...  # (vLLM staged) bench_serving.py ARGS of this tree and of
#                                          # the tree in folder BASE (made and carried as for `ab`), each tree's own
#                                          # script, engines and plugin in turn: A B, then B A with SERVING_AB_ROUNDS=2
#                                          # (each run ~3 minutes at one point: one round a call)
#   bash scripts/device_check.sh ab BASE [ARGS]   # this tree's kernel benchmarks against the tree in folder BASE, each
#                                          # tree's own bench_kernels.py in fresh processes, ABBA order (bench_ab.py;
#                                          # ARGS go to it, default `--rounds 2 --only scan,conv,prefill,decode`). BASE is
#                                          # made here and carried, e.g. the tree before the history-branch seam:
#                                          # `mkdir seam-base && git archive 4f1aa59 modeling configuration scripts
#                                          # vllm_integration | tar -x -C seam-base` (seam-base/ in .git/info/exclude)
#
# Tensor and pipeline parallel on the two-GPU kind, in two calls of one lease (each inside the 10-minute limit):
#   bash scripts/device_check.sh vllm "tensor_parallel or pipeline_parallel or lora"   # TP 2, PP 2, LoRA at TP 1/2
#   bash scripts/device_check.sh serving --models hybrid-v2,swa --prompt-lens 32768 --tensor-parallel-size 2
# and the TP 1 anchor beside them: `serving --models hybrid-v2 --prompt-lens 32768`; then
# `python3 scripts/bench_serving.py --report TP1.json TP2.json` compares each TP 2 run with its TP 1 run.
#
# The device image has no pytest: it is carried as wheels in .whl/ (git-ignored; see BENCHMARKS.md for the command
# that downloads them) and installed to /tmp/site.
set -uo pipefail
OUT=${OUT:-outputs/device}
mkdir -p "$OUT"
if ! python3 -c "import pytest" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv
git log -1 --format='commit %H %s' 2>/dev/null || true
runner="VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER-unset}"
echo "$runner"

# The two trees of round ROUND (from 1) of a side-by-side run against folder BASE, in ABBA order: this tree (.) first
# in odd rounds; and the label a tree's outputs are named by.
ab_trees() { if (($1 % 2)); then echo ". $2"; else echo "$2 ."; fi; }
ab_label() { if [[ $1 == . ]]; then echo this; else basename "$1"; fi; }

case "${1:-kernels}" in
  kernels)
    python3 -m pytest -q -p no:warnings tests/test_selective_scan_triton.py tests/test_causal_conv1d_triton.py \
      tests/vllm_ops/test_paged_attention.py tests/vllm_ops/test_hybrid_decode.py \
      tests/test_modeling_kernels.py \
      tests/test_mamba_inner_triton.py tests/test_ssd.py tests/test_mamba2_inner.py tests/test_mamba2.py tests/test_modeling.py 2>&1 | tee "$OUT/pytest_kernels.log" | tail -15
    tests_status=${PIPESTATUS[0]}
    python3 scripts/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
    exit $((tests_status || PIPESTATUS[0]))
    ;;
  ssd)
    # Mamba-2's chunked scan and its fused branch op on their Triton kernels: against the references (gradients
    # included), in the model's training step (eager and compiled) and generation. One line a test (-v), so that a
    # call cut by its limit still names what passed and what failed; the slowest tests listed for planning.
    timeout 560 python3 -m pytest -v -p no:warnings --durations=15 tests/test_ssd.py tests/test_mamba2_inner.py \
      tests/test_mamba2.py tests/test_modeling_kernels.py 2>&1 | tee "$OUT/pytest_ssd.log" \
      | grep -E "FAILED|ERROR|passed|failed|^[0-9.]+s (call|setup)" | tail -40
    exit "${PIPESTATUS[0]}"
    ;;
  ssd-bench)
    # The scan timed against the Inductor-compiled reference it replaced, the Mamba-1 scan and causal attention; the
    # training step of both branches against the model without the branch.
    python3 scripts/bench_kernels.py --only ssd,train --json "$OUT/bench_ssd_train.json" 2>&1 \
      | tee "$OUT/bench_ssd_train.log" | tail -25
    exit "${PIPESTATUS[0]}"
    ;;
  mamba2-prefill)
    timeout 200 python3 -m pytest -q -p no:warnings tests/test_ssd.py -k "varlen or norm_kernels" \
      tests/test_causal_conv1d_triton.py 2>&1 | tee "$OUT/pytest_mamba2_prefill.log" | tail -5
    tests_status=${PIPESTATUS[0]}
    bench_status=0
    for shape in 1x8192 8x1024; do
      timeout 150 python3 scripts/bench_kernels.py --only prefill --prefill-seqs "${shape%x*}" \
        --prefill-seq-len "${shape#*x}" --serve-channels 2048 --json "$OUT/prefill-$shape.json" 2>&1 \
        | tee "$OUT/prefill-$shape.log" | tail -16
      ((PIPESTATUS[0])) && bench_status=1
    done
    # The scan's launch shapes at the serving prefill step, and its two kernels' times.
    timeout 150 python3 scripts/bench_kernels.py --only ssd_varlen_sweep --prefill-seqs 1 --prefill-seq-len 8192 \
      --serve-channels 2048 --json "$OUT/ssd-varlen-sweep.json" 2>&1 | tee "$OUT/ssd-varlen-sweep.log" | tail -18
    ((PIPESTATUS[0])) && bench_status=1
    exit $((tests_status || bench_status))
    ;;
  mamba2-steps)
    mamba2=(--set ssm_type=mamba2 --set ssm_state_size=128)
    timeout 200 python3 scripts/bisect_train_step.py . --swa-tree . --rounds 1 --profile-trees . "${mamba2[@]}" \
      --json "$OUT/train_step_mamba2.json" 2>&1 | tee "$OUT/train_step_mamba2.log" | tail -40
    eager_status=${PIPESTATUS[0]}
    timeout 360 python3 scripts/bisect_train_step.py . --swa-tree . --rounds 1 --compile "${mamba2[@]}" \
      --json "$OUT/train_step_mamba2_compiled.json" 2>&1 | tee "$OUT/train_step_mamba2_compiled.log" | tail -6
    exit $((eager_status || PIPESTATUS[0]))
    ;;
  sweep)
    python3 scripts/bench_kernels.py --only sweep,scan_sweep --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | tail -80
    # The serving scan at the serving benchmark's prefill step (one 8192-token sequence, E 2048).
    python3 scripts/bench_kernels.py --only prefill_scan_sweep --prefill-seqs 1 --prefill-seq-len 8192 \
      --serve-channels 2048 --json "$OUT/prefill_scan_sweep.json" 2>&1 | tee "$OUT/prefill_scan_sweep.log" | tail -30
    ;;
  vllm)
    export VLLM_USE_FLASHINFER_SAMPLER=0
    # One pytest per test, each under its own time limit, so that a slow or failing test neither hides the others'
    # results nor loses its own report when the call's limit comes.
    status=0
    echo "$runner" >> "$OUT/pytest_vllm.log"  # a saved log says which model runner its engines ran on
    # The engine tests (test_vllm.py: Transformers' tokens through vLLM) first: a call's time limit cuts the last ones
    tests=$(python3 -m pytest -q --collect-only -p no:warnings tests/test_vllm.py tests/test_vllm_triton_path.py \
            tests/test_vllm_mamba2_triton_path.py tests/test_vllm_mamba2_tensor_parallel.py tests/test_vllm_ssm_metadata.py \
            ${2:+-k "$2"} \
            | grep '::')
    if [[ -z $tests ]]; then
      echo "no vLLM test collected: is vLLM staged and importable?" >&2
      exit 1
    fi
    for test in $tests; do
      echo "=== $test" >> "$OUT/pytest_vllm.log"
      timeout "${VLLM_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:warnings -rA --tb=short "$test" \
        >> "$OUT/pytest_vllm.log" 2>&1
      rc=$?
      echo "rc=$rc $test"
      status=$((status || rc))
    done
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|Error|assert" "$OUT/pytest_vllm.log" | tail -30
    exit $status
    ;;
  steps)
    shift
    # One SSM branch's training step: host work on the fused op and on the module path, side by side.
    python3 scripts/bench_host_work.py --python-profile 30 --json "$OUT/host_work.json" 2>&1 | tee "$OUT/host_work.log"
    # A generate() decode step's host work (dynamic cache): the hybrid's fused branch step and module path, Mistral;
    # each path's cProfile table says what a Triton launch costs on this host (its own Python, the binder, the driver).
    python3 scripts/bench_host_work.py --decode --python-profile 40 --json "$OUT/host_work_decode.json" 2>&1 | tee "$OUT/host_work_decode.log"
    python3 scripts/bisect_train_step.py . "$@" --swa-tree . --rounds "${STEP_ROUNDS:-3}" --profile-trees . \
      --budget-s "${STEP_BUDGET_S:-200}" --json "$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.log" | tail -12
    train_status=${PIPESTATUS[0]}
    timeout "${GENERATE_TIMEOUT_S:-330}" python3 scripts/bench_generate.py --shape small --caches "${GENERATE_CACHES:-static,dynamic}" \
      --models "${GENERATE_MODELS:-hybrid,swa}" --repeats 3 \
      --json "$OUT/generate_small.json" 2>&1 | tee "$OUT/generate_small.log" | tail -8
    exit $((train_status || PIPESTATUS[0]))
    ;;
  lm)
    # One bench_lm.py run (issue 31's memory program), its results JSON and log brought back; the corpus is built in
    # the call (the machine keeps nothing between leases). E.g. `lm --models hybrid --steps 800 --seed 1 --tag seed1
    # --commit $(git rev-parse --short HEAD)`: give --commit, the device copy's git metadata lags the working tree.
    # Two runs share one GPU in a call (each ~480 s at the base shape, 800 steps) when each has its own
    # LM_OUTPUT_DIR and TORCHINDUCTOR_CACHE_DIR: `LM_OUTPUT_DIR=/tmp/lm1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 bash
    # scripts/device_check.sh lm ... & LM_OUTPUT_DIR=/tmp/lm2 ... & wait` (their tok/s then halve), and each its own
    # --tag: the results are brought back by model and tag, and the second run of a pair would overwrite the first.
    shift
    name=bench_lm-$(date +%H%M%S)-$$
    dir=${LM_OUTPUT_DIR:-outputs/bench_lm}
    timeout "${LM_TIMEOUT_S:-560}" python3 scripts/bench_lm.py --corpus-bytes 600000000 --output-dir "$dir" \
      "$@" > "$OUT/$name.log" 2>&1
    status=$?
    ((status == 124)) && echo "bench_lm.py ran out of the call's time: only the models finished before are saved"
    cp "$dir"/results-*.json "$OUT/" 2>/dev/null
    for record in "$dir"/*/trained/training.json; do  # --stage train's records (a run's training figures)
      [[ -f $record ]] && cp "$record" "$OUT/training-$(basename "$(dirname "$(dirname "$record")")").json"
    done
    grep -v "it/s\]\|^{'loss'" "$OUT/$name.log" | tail -40
    exit "$status"
    ;;
  startup)
    export VLLM_USE_FLASHINFER_SAMPLER=0
    timeout 420 python3 scripts/check_engine_start.py /tmp/engine_start 2>&1 | tee "$OUT/engine_start.log" \
      | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -20
    status=${PIPESTATUS[0]}
    ((status == 124)) && echo "LLM() did not start within the time limit: the engine hung"
    exit "$status"
    ;;
  serving)
    shift
    export VLLM_USE_FLASHINFER_SAMPLER=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    name=serving-$(date +%H%M%S)
    touch "/tmp/$name.start"
    timeout 540 python3 scripts/bench_serving.py "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -40
    status=${PIPESTATUS[0]}
    # The workers' logs of this run only: each one's start (engine setup: backends, CUDA graphs) and its end.
    for log in $(find outputs/bench_serving -name '*.log' -newer "/tmp/$name.start"); do
      { echo "===== $log"; head -c 12000 "$log"; echo; echo "[...]"; tail -c 12000 "$log"; } >> "$OUT/$name-workers.log"
    done
    exit "$status"
    ;;
  both)
    tests_k=${2?usage: $0 both K ARGS...}
    shift 2
    if (( $(nvidia-smi -L | wc -l) < 2 )); then
      echo "both needs two GPUs (the nvidia-h200-x2 kind)" >&2
      exit 2
    fi
    # Inside the device call's 10 minutes, so that this summary and the exit status come back.
    CUDA_VISIBLE_DEVICES=0 timeout 560 bash "$0" vllm "$tests_k" > "$OUT/both-vllm.log" 2>&1 &
    tests_pid=$!
    CUDA_VISIBLE_DEVICES=1 bash "$0" serving "$@" > "$OUT/both-serving.log" 2>&1
    serving_status=$?
    wait "$tests_pid"
    tests_status=$?
    echo "=== vllm $tests_k (GPU 0)"; tail -n 25 "$OUT/both-vllm.log"
    echo "=== serving $* (GPU 1)"; tail -n 30 "$OUT/both-serving.log"
    exit $((tests_status || serving_status))
    ;;
  generate-ab)
    base=${2?usage: $0 generate-ab BASE [ARGS]}
    shift 2
    status=0
    for round in 1 2; do
      for tree in $(ab_trees "$round" "$base"); do
        label=$(ab_label "$tree")
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-generate-$label timeout 270 python3 "$tree/scripts/bench_generate.py" \
          --shape small --caches static --models hybrid,swa --repeats 3 --json "$OUT/generate-$label-$round.json" "$@" \
          > "$OUT/generate-$label-$round.log" 2>&1 || status=1
        echo "== $label, round $round"; grep -E "new tok/s" "$OUT/generate-$label-$round.log"
      done
    done
    exit "$status"
    ;;
  serving-ab)
    base=${2?usage: $0 serving-ab BASE ARGS...}
    shift 2
    export VLLM_USE_FLASHINFER_SAMPLER=0
    status=0
    for ((round = 1; round <= ${SERVING_AB_ROUNDS:-1}; round++)); do
      for tree in $(ab_trees "$round" "$base"); do
        label=$(ab_label "$tree")
        # Each tree's script puts its own root first on the path, and its engine workers inherit that root: the
        # plugin vLLM loads is that tree's.
        (cd "$tree" && timeout "${SERVING_AB_TIMEOUT_S:-270}" python3 scripts/bench_serving.py "$@" \
          --work-dir "/tmp/serving-ab-$label" --json "$OUT/serving-$label-$round.json") \
          > "$OUT/serving-$label-$round.log" 2>&1 || status=1
        echo "== $label, round $round"; tail -n 6 "$OUT/serving-$label-$round.log"
      done
    done
    exit "$status"
    ;;
  ab)
    base=${2?usage: $0 ab BASE [ARGS]}
    shift 2
    (($#)) || set -- --rounds 2 --only scan,conv,prefill,decode
    timeout 560 python3 scripts/bench_ab.py --base "$base" --log-dir "$OUT/ab_logs" --json "$OUT/ab.json" "$@" 2>&1 \
      | tee "$OUT/ab.log" | tail -40
    exit "${PIPESTATUS[0]}"
    ;;
  *)
    echo "usage: $0 kernels|ssd|ssd-bench|mamba2-prefill|mamba2-steps|sweep|vllm [K]|steps [TREES]|lm ARGS|startup|serving ARGS|both K ARGS|ab BASE [ARGS]|generate-ab BASE [ARGS]|serving-ab BASE ARGS" >&2
    exit 2
    ;;
esac
