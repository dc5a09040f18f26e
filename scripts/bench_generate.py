"""Transformers `generate()` of the hybrid against `MistralForCausalLM` (the sliding-window model it extends) of the
same shapes: random weights, greedy, the batch prefilled and then decoded token by token, as a user's script would.

    python scripts/bench_generate.py --json $OUT/generate.json        # batch 8, 2048-token prompts, 128 new, bf16
    python scripts/bench_generate.py --profile                        # also each model's top kernels and host syncs
    python scripts/bench_generate.py --caches dynamic,static          # also the static cache (compiled decode step)
    python scripts/bench_generate.py --shape small                    # the ~400M training-benchmark shape
    python scripts/bench_generate.py --models hybrid,hybrid-mamba2,swa  # also the hybrid with a Mamba-2 branch
    python scripts/bench_generate.py --smoke                          # tiny models on CPU (fp32)
    python scripts/bench_generate.py --caches static --skip-module-guards   # both models' compiled step without
                                                                      # Dynamo's guards on modules and parameters
    python scripts/bench_generate.py --caches static --freezing       # ... with the weights folded into the graph

Per model and cache: the median over `--repeats` runs (after one warm-up, which compiles the decode step of a static
cache: `generate()` does so on CUDA with CUDA graphs) of the whole `generate()` and of the prefill alone
(`max_new_tokens=1`); new tok/s = batch x new tokens / whole time, and the decode step = (whole - prefill) / (new - 1).
The `serving` shape (default) is the serving benchmark's ~1B model (tools/serving_benchmark); `small` is
the ~400M model of the training step (hidden 1024, 24 layers, 16/4 heads x 64, W 1024), whose shorter steps show what
the hybrid's decode step costs beyond Mistral's in launches and host work. Results: BENCHMARKS.md.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling import HybridForCausalLM  # noqa: E402
from tools.provenance import head_commit  # noqa: E402
from tools.serving_benchmark.checkpoints import baseline_config, hybrid_config  # noqa: E402
from tools.serving_benchmark.driver import FULL, SMOKE  # noqa: E402

SHAPES = {
    "serving": FULL,
    "small": dict(FULL, hidden_size=1024, intermediate_size=2816, ssm_intermediate_size=1024, window=1024),
}

# Runtime calls after which the host waits for the GPU (`.item()`, `.tolist()`, a host-side copy, a sync).
HOST_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


# What `--models` takes: the hybrid (Mamba-1 branch), the hybrid with the serving benchmark's Mamba-2 branch, and
# the anchor, Transformers' Mistral of the same shapes.
MODELS = ("hybrid", "hybrid-mamba2", "swa")


def build_models(shape: dict, max_len: int, device: str, dtype: torch.dtype, names=("hybrid", "swa")) -> dict:
    from transformers import MistralForCausalLM

    torch.manual_seed(0)
    # The serving baseline's config names every layer's type for vLLM; Transformers' Mistral slides every layer by
    # `sliding_window` alone, and with `layer_types` set its forward cannot take the masks generate() builds for a
    # static cache.
    swa = baseline_config("swa", hybrid_config(shape, max_len))
    del swa.layer_types
    models = {}
    with torch.device(device):
        for name in names:
            models[name] = (
                MistralForCausalLM(swa) if name == "swa" else HybridForCausalLM(hybrid_config(shape, max_len, name))
            )
    return {name: model.to(dtype).eval() for name, model in models.items()}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, input_ids, new_tokens: int, device: str, cache: str) -> tuple[float, torch.Tensor]:
    """Seconds for one greedy `generate()` of exactly `new_tokens` tokens per row with the `cache` implementation,
    and its output."""
    mask = torch.ones_like(input_ids)
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(
        input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        cache_implementation=cache,
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    if output.shape != (input_ids.shape[0], input_ids.shape[1] + new_tokens):
        raise RuntimeError(f"generate() returned {tuple(output.shape)}, expected {new_tokens} new tokens per row")
    return seconds, output


def host_syncs_and_kernels(model, input_ids, new_tokens: int, device: str, cache: str) -> tuple[float, str]:
    """Host syncs per new token, and the top kernels and top host-side ops (by self CPU time: what a step spends
    outside its kernels), of one `generate()` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_generate(model, input_ids, new_tokens, device, cache)
    events = prof.key_averages()
    syncs = sum(event.count for event in events if event.key in HOST_SYNC_EVENTS)
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device == "cuda":
        tables.insert(0, events.table(sort_by="self_cuda_time_total", row_limit=20))
    return syncs / new_tokens, "\n".join(tables)


def cudagraph_skips() -> int:
    """How many compiled graphs Inductor ran without CUDA graphs so far (each skip's reason goes to stderr through the
    `perf_hints` log that `main` turns on): a static cache's decode step should be one graph replay."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def measure(model, args, device: str, cache: str) -> dict:
    skips_before = cudagraph_skips()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), generator=generator)
    input_ids = input_ids.to(device)
    with torch.inference_mode():
        # Warm-up: kernels (and a static cache's decode step) compiled, allocator grown.
        timed_generate(model, input_ids, args.new_tokens, device, cache)
        whole = [timed_generate(model, input_ids, args.new_tokens, device, cache)[0] for _ in range(args.repeats)]
        prefill = [timed_generate(model, input_ids, 1, device, cache)[0] for _ in range(args.repeats)]
        result = {
            "whole_s": statistics.median(whole),
            "prefill_s": statistics.median(prefill),
            "whole_runs_s": whole,
            "prefill_runs_s": prefill,
        }
        result["new_tok_per_s"] = args.batch * args.new_tokens / result["whole_s"]
        result["decode_step_ms"] = 1e3 * (result["whole_s"] - result["prefill_s"]) / (args.new_tokens - 1)
        result["cudagraph_skips"] = cudagraph_skips() - skips_before
        if args.profile:
            result["host_syncs_per_token"], result["top_kernels"] = host_syncs_and_kernels(
                model, input_ids, args.new_tokens, device, cache
            )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--caches", default="dynamic", help="comma-separated cache implementations: dynamic, static (default dynamic)"
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="serving", help="model shape (default serving)")
    parser.add_argument("--models", default="hybrid,swa", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--profile", action="store_true", help="also each model's top kernels and host syncs")
    parser.add_argument("--smoke", action="store_true", help="tiny models and lengths, on CPU in fp32")
    parser.add_argument(
        "--skip-module-guards",
        action="store_true",
        help="compile every model's static-cache decode step without Dynamo's guards on modules and parameters "
        "(torch.compiler.skip_guard_on_all_nn_modules_unsafe, through the generation config's CompileConfig): "
        "what the guard check costs each step, which grows with a model's parameter tensors",
    )
    parser.add_argument(
        "--freezing",
        action="store_true",
        help="compile every model's static-cache decode step with Inductor's freezing (the weights folded into the "
        "graph as constants, so that they are no longer its inputs): what the compiled step's per-input work costs",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD)")
    args = parser.parse_args(argv)
    caches = args.caches.split(",")
    if not set(caches) <= {"dynamic", "static"}:
        parser.error(f"--caches: expected dynamic and/or static, got {args.caches!r}")
    names = args.models.split(",")
    if not set(names) <= set(MODELS) or "swa" not in names:
        parser.error(
            f"--models: expected some of {', '.join(MODELS)}, swa (the anchor) among them; got {args.models!r}"
        )
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the decode step is timed from the tokens after the first")
    for flag, value in (("--repeats", args.repeats), ("--batch", args.batch), ("--prompt-len", args.prompt_len)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.smoke:
        device, dtype, shape = "cpu", torch.float32, SMOKE
        args.batch, args.prompt_len, args.new_tokens = min(args.batch, 2), min(args.prompt_len, 40), 4
    elif torch.cuda.is_available():
        device, dtype, shape = "cuda", torch.bfloat16, SHAPES[args.shape]
    else:
        parser.error("the full benchmark needs a CUDA GPU (--smoke runs tiny models on CPU)")

    if device == "cuda":
        torch._logging.set_logs(perf_hints=True)  # why Inductor skips CUDA graphs for a graph, if it does
    models = build_models(shape, args.prompt_len + args.new_tokens, device, dtype, names)
    if args.skip_module_guards or args.freezing:
        from transformers import CompileConfig

        # generate()'s default mode, "reduce-overhead", is Inductor's CUDA graphs: torch.compile takes a mode or
        # options, not both
        options = {"triton.cudagraphs": True}
        if args.skip_module_guards:
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        if args.freezing:
            options["freezing"] = True
        for model in models.values():
            model.generation_config.compile_config = CompileConfig(mode=None, options=options)
    meta = {
        "commit": args.commit or head_commit(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "dtype": str(dtype),
            "shape_name": "smoke" if args.smoke else args.shape,
            "shape": {key: value for key, value in shape.items() if not isinstance(value, tuple)},
            "attn_implementation": models["swa"].config._attn_implementation,
            "skip_module_guards": args.skip_module_guards,
            "freezing": args.freezing,
        },
    }
    results = {}
    for cache in caches:
        for name, model in models.items():
            row = results.setdefault(cache, {})[name] = measure(model, args, device, cache)
            print(
                f"{name:13s} {cache:8s} new tok/s {row['new_tok_per_s']:9.1f}   whole {row['whole_s']:.3f} s   "
                f"prefill {row['prefill_s']:.3f} s   decode step {row['decode_step_ms']:.2f} ms   "
                f"graphs run without CUDA graphs {row['cudagraph_skips']}",
                flush=True,
            )
            if args.profile:
                print(f"host syncs per new token: {row['host_syncs_per_token']:.2f}\n{row['top_kernels']}", flush=True)
            if args.json:  # after every run: a device call cut by its time limit keeps what finished
                Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    ratios = {
        cache: {
            name: row["new_tok_per_s"] / rows["swa"]["new_tok_per_s"] for name, row in rows.items() if name != "swa"
        }
        for cache, rows in results.items()
    }
    for cache, by_model in ratios.items():
        for name, ratio in by_model.items():
            print(f"{name} / swa new tok/s, {cache} cache: {ratio:.3f}x")

    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "over_swa": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
