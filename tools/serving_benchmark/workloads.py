"""What is timed, in one engine: a point (all the sequences one prompt length admits decoding together, and one
alone), an end-to-end workload (requests submitted at once, wall time to the last token), and a shared-prefix
workload with prefix caching."""

import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from .engine import Engine


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


@dataclass
class EndToEnd:
    """One model serving `requests` prompts of `prompt_len` tokens, `output_len` tokens each, submitted at once."""

    model: str
    prompt_len: int
    requests: int
    output_len: int
    seconds: float  # median wall time from submission to the last request's last token
    runs_s: list[float]
    output_tok_s: float  # requests x output_len / seconds


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


def end_to_end(engine: Engine, model: str, prompt_len: int, requests: int, spec: dict) -> EndToEnd:
    """What a user's offline batch feels: `requests` prompts submitted at once to `LLM.generate`, prefills and decodes
    scheduled by vLLM as it does, timed from submission to the last token; the median of `spec["repeats"]` runs
    (the same prompts each time, no prefix caching)."""
    from vllm import SamplingParams

    output_len = spec["output_len"]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(requests, prompt_len, spec["vocab_size"], seed=3)]
    runs = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        outputs = engine.llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        if short := [len(o.outputs[0].token_ids) for o in outputs if len(o.outputs[0].token_ids) != output_len]:
            raise RuntimeError(f"{model} L={prompt_len}: {len(short)} requests did not give {output_len} tokens")
    seconds = statistics.median(runs)
    return EndToEnd(model, prompt_len, requests, output_len, seconds, runs, requests * output_len / seconds)


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
