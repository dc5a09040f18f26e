"""Runs vLLM on a spec and prints the results as JSON: a separate process, as vLLM wants its own `__main__`.

    python tests/vllm_generate.py SPEC.json
    (prints {"outputs": [{"token_ids": [...], "logprobs": [...], "cached_tokens": n}, ...], "preemptions": n,
             "cache_config": {the engine's effective CacheConfig fields CACHE_FIELDS, as vLLM decided them}})

SPEC: {"model": dir, "llm": {LLM kwargs}, "requests": [[prompt token ids], ...], "max_tokens": n,
       "alone": bool (also generate each request in its own call; returned as "alone_outputs"),
       "state_dtypes": bool (also return the dtypes of the SSM state caches vLLM allocated, conv and ssm, per layer,
                       as "state_dtypes", and of the KV caches as "kv_dtypes" with the bytes each element takes
                       there as "kv_element_bytes"; needs the engine in this process:
                       VLLM_ENABLE_V1_MULTIPROCESSING=0),
       "adapters": [LoRA adapter dir or null, one per request] (optional: each request with its adapter, or none),
       "refused": [[prompt token ids], ...] (optional: each sent first, alone; what the engine raised is returned
                  as "refusals", "Type: message" each, or null where it generated)}
"""

import json
import sys

# Whether prefix caching is on, the Mamba cache mode ("none", "align", on 0.26 also "all") that goes with it, and the
# block size the engine reported back. (Not `mamba_block_size`: vLLM 0.32's engine core does not take the worker's
# aligned one back, and reports the value from before the alignment.)
CACHE_FIELDS = ("enable_prefix_caching", "mamba_cache_mode", "block_size")


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], disable_log_stats=False, **spec["llm"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True)

    def generate(requests, adapters=None):
        lora_requests = None
        if adapters is not None:
            from vllm.lora.request import LoRARequest

            adapter_ids = {path: i + 1 for i, path in enumerate(dict.fromkeys(p for p in adapters if p))}
            lora_requests = [
                LoRARequest(f"adapter{adapter_ids[p]}", adapter_ids[p], p) if p else None for p in adapters
            ]
        prompts = [{"prompt_token_ids": ids} for ids in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        return [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "logprobs": [next(iter(step.values())).logprob for step in o.outputs[0].logprobs],
                # The request's own count of prompt tokens served from the prefix cache. (vLLM's global
                # prefix-cache counters missed most lookups on Model Runner V2 in 0.26: 200 query tokens
                # counted where ten requests of 97-129 tokens were looked up.)
                "cached_tokens": o.num_cached_tokens or 0,
            }
            for o in outputs
        ]

    result = {}
    if spec.get("refused"):
        result["refusals"] = []
        for ids in spec["refused"]:
            try:
                generate([ids])
                result["refusals"].append(None)
            except Exception as error:  # what a client of the engine would see
                result["refusals"].append(f"{type(error).__name__}: {error}")
    result["outputs"] = generate(spec["requests"], spec.get("adapters"))
    if spec.get("alone"):
        result["alone_outputs"] = [generate([ids])[0] for ids in spec["requests"]]
    if spec.get("state_dtypes"):
        (result["state_dtypes"],) = llm.apply_model(
            lambda model: [[str(t.dtype) for t in m.kv_cache] for n, m in model.named_modules() if n.endswith(".ssm")]
        )
        # The KV cache as the attention impl reads it (fp8 caches are allocated as bytes and viewed as fp8).
        (kv_caches,) = llm.apply_model(
            lambda model: [
                (m.kv_cache_dtype, m.kv_cache.element_size())
                for n, m in model.named_modules()
                if n.endswith(".attn") and hasattr(m, "kv_cache_dtype")
            ]
        )
        result["kv_dtypes"] = [dtype for dtype, _ in kv_caches]
        result["kv_element_bytes"] = [element_bytes for _, element_bytes in kv_caches]
    cache_config = llm.llm_engine.vllm_config.cache_config
    result["cache_config"] = {name: getattr(cache_config, name) for name in CACHE_FIELDS}
    counters = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    result["preemptions"] = counters.get("vllm:num_preemptions", 0)
    return result


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print("RESULT_JSON " + json.dumps(run(spec)))
