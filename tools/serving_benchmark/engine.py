"""vLLM's engine, in this process, stepped by hand: its scheduler's KV-cache pool is readable, so what a sequence
holds is read from it, and every timed step is one engine step."""

import itertools
import time

import torch


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

    def warm_up(self, prompts: list[list[int]]) -> None:
        """Compiles what the batch compositions of serving compile, before anything is timed: the `prompts` arrive one
        per engine step until all of them run (mixed batches of 0 to len(prompts) - 1 decodes beside one prefill,
        which take the fused decode with and without split-K), then leave. A server that has run before finds its
        Triton kernels in Triton's disk cache; a fresh machine compiles them while serving its first requests, which
        is not what the timed points measure."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=len(prompts) + 8, temperature=0.0, ignore_eos=True, detokenize=False)
        ids = []
        for prompt in prompts:
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
