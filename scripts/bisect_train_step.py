"""Times the training step of several trees of this repository in one lease, to find which commit made it slower:
each tree's own `configuration` and `modeling` in a fresh process, the trees in turn round after round (the order
reversed every other round), so that drift during the lease falls on all of them alike. Any tree since November
runs: the probe uses only `HybridConfig`'s fields and `HybridForCausalLM`.

    for rev in 576bc0f 056d2d1 HEAD; do
      mkdir -p outputs/trees/$rev && git archive $rev modeling configuration | tar -x -C outputs/trees/$rev
    done
    python3 scripts/bisect_train_step.py outputs/trees/* --rounds 2 --swa-tree outputs/trees/HEAD \\
        --profile-trees outputs/trees/576bc0f,outputs/trees/HEAD --json $OUT/bisect.json

The step: a 383M hybrid (hidden 1024, 24 layers, 16/4 heads x 64, W 1024, tied embeddings), B 2 x T 4096 random
tokens, bf16 weights, fused AdamW, SDPA, no attention mask; the median of 5 steps after 2 warm-ups, with the peak
memory, and how long the host takes to issue a step (about the step's wall time when it is host-bound). `--swa-tree`
adds that tree's model with the SSM branch off (the anchor); `--profile-trees` adds, once per
tree, one profiled step: its top CUDA kernels and its host syncs, and with `--swa-tree` one profiled step of the
anchor too and what the branch adds to it, kernel by kernel (each GPU kernel's time and launches: where the
hybrid's extra GPU time goes); `--sync-sites` lists where each tree's hybrid and
SSM-off steps make the host wait for the GPU (PyTorch's sync debug mode, with the Python stack of each).
`--compile` runs every model under `torch.compile` (as `Trainer(torch_compile=True)` does), with the time its first
step took to compile and the graph breaks Dynamo met. `--set KEY=VALUE` (repeatable; VALUE read as JSON, else as
a string) changes a field of every probe's config, e.g. `--set ssm_type=mamba2 --set ssm_state_size=128` for the
Mamba-2 branch.
"""

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "sliding_window": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def training_step(model, batch_size: int, seq_len: int):
    """A full training step of `model` on fixed random tokens (forward, backward, fused AdamW), as a closure."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), device=model.device)

    def step():
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_times_ms(step, steps: int) -> list[float]:
    """Wall milliseconds of `steps` calls of `step` after two warm-up calls, the GPU synchronised around each."""
    import torch

    times = []
    for i in range(2 + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def host_enqueue_ms(step, steps: int) -> list[float]:
    """Milliseconds the host takes to issue each of `steps` calls of `step` (until it returns, the GPU left to finish
    after it): about the wall time when the step is host-bound, well under it when the GPU is the bottleneck."""
    import torch

    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return times


def sync_sites(step) -> dict[str, int]:
    """The Python stacks (innermost frames) of the ops in one `step()` that synchronize the host with the GPU."""
    import torch

    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]]
        sites[" <- ".join(reversed(frames[-6:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return dict(sites.most_common())


def config_field(text: str) -> tuple[str, object]:
    """`--set`'s KEY=VALUE: the value as JSON where it parses (numbers, booleans), else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


@dataclasses.dataclass(frozen=True)
class Probe:
    """What one run of a tree measures, handed from the parent to the worker process as JSON. `compile`: the model
    under `torch.compile` (its default mode; its first step compiles, timed apart), as `Trainer(torch_compile=True)`
    runs it; `fields`: config fields over `CONFIG`'s (`--set`)."""

    use_ssm_branch: bool = True
    profile: bool = False
    steps: int = 5
    find_syncs: bool = False
    compile: bool = False
    fields: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Probe":
        return cls(**json.loads(text))


def worker(probe: Probe) -> dict:
    """One tree's step, in this process (the tree first on sys.path)."""
    import torch

    import modeling
    from configuration import HybridConfig
    from modeling import HybridForCausalLM

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    if tree not in Path(modeling.__file__).resolve().parents:
        raise RuntimeError(f"imported {modeling.__file__}, not the tree's modeling under {tree}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        config = HybridConfig(**CONFIG | probe.fields, use_ssm_branch=probe.use_ssm_branch)
        model = HybridForCausalLM(config).to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    model.train()
    if probe.compile:
        model.forward = torch.compile(model.forward)
    step = training_step(model, batch_size=2, seq_len=4096)
    if probe.compile:
        started = time.perf_counter()
        step()  # compiles the forward and the backward
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
    times = step_times_ms(step, probe.steps)
    result = {
        "step_ms": statistics.median(times),
        "steps_ms": times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_ms": statistics.median(host_enqueue_ms(step, probe.steps)),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if probe.compile:
        from torch._dynamo.utils import counters

        result["compile_s"] = compile_s
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graph_break_reasons"] = sorted(counters["graph_break"])[:10]
    if probe.find_syncs:
        result["sync_sites"] = sync_sites(step)
    if probe.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        result["host_syncs"] = sum(event.count for event in events if event.key in HOST_SYNCS)
        kernels = [event for event in events if event.device_type.name == "CUDA"]
        result["gpu_kernel_ms"] = sum(event.self_device_time_total for event in kernels) / 1e3
        # Each kernel's GPU time and launches, what `kernel_differences` compares between a hybrid and its anchor.
        # The kernels alone: a CPU op's self device time is its kernels' again, and would count them twice.
        result["kernel_gpu_ms"] = {event.key: [event.self_device_time_total / 1e3, event.count] for event in kernels}
        result["top_kernels"] = events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    return result


def kernel_differences(hybrid: dict, anchor: dict, rows: int = 20) -> str:
    """The kernels whose GPU time differs most between two profiled steps (`worker`'s `kernel_gpu_ms`), largest
    difference first: GPU ms and launches in each, and the difference."""
    keys = set(hybrid) | set(anchor)
    zero = [0.0, 0]
    delta = {key: hybrid.get(key, zero)[0] - anchor.get(key, zero)[0] for key in keys}
    lines = [f"{'kernel':70s} {'hybrid ms':>10s} {'calls':>6s} {'anchor ms':>10s} {'calls':>6s} {'+ms':>8s}"]
    for key in sorted(keys, key=lambda k: -abs(delta[k]))[:rows]:
        (h_ms, h_calls), (a_ms, a_calls) = hybrid.get(key, zero), anchor.get(key, zero)
        lines.append(f"{key[:70]:70s} {h_ms:10.2f} {h_calls:6d} {a_ms:10.2f} {a_calls:6d} {delta[key]:+8.2f}")
    lines.append(f"{'all kernels':70s} {'':>10s} {'':>6s} {'':>10s} {'':>6s} {sum(delta.values()):+8.2f}")
    return "\n".join(lines)


def run_tree(tree: Path, probe: Probe) -> dict:
    """`worker(probe)` in a fresh process on `tree`'s own packages; its result, or the end of its error output."""
    command = [sys.executable, __file__, "--worker", str(tree), "--probe", probe.to_json()]
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--swa-tree", type=Path, help="also this tree with use_ssm_branch=False (the anchor)")
    parser.add_argument(
        "--profile-trees",
        default="",
        help="comma-separated trees to profile one step of, once (compiled with --compile)",
    )
    parser.add_argument("--sync-sites", action="store_true", help="list where the trees' steps wait for the GPU")
    parser.add_argument("--budget-s", type=float, default=540, help="start no run after this many seconds")
    parser.add_argument(
        "--compile", action="store_true", help="every model under torch.compile (the step times exclude compiling)"
    )
    parser.add_argument(
        "--set",
        type=config_field,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config field of every probe (repeatable)",
    )
    parser.add_argument("--json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--probe", type=Probe.from_json, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.probe)))
        return 0
    fields = dict(args.set)
    if args.sync_sites:
        for tree in args.trees:
            for use_ssm_branch in (True, False):
                result = run_tree(tree, Probe(use_ssm_branch, steps=1, find_syncs=True, fields=fields))
                print(f"== {tree.name} {'hybrid' if use_ssm_branch else 'SSM off'}: {result.get('error', '')}")
                for site, count in result.get("sync_sites", {}).items():
                    print(f"{count:4d}  {site}")
        return 0

    runs = [(tree, True) for tree in args.trees] + ([(args.swa_tree, False)] if args.swa_tree else [])
    label = {run: f"{run[0].resolve().name}{'' if run[1] else ' (SSM off)'}" for run in runs}
    results = {label[run]: {"steps_ms": [], "runs": []} for run in runs}
    started = time.perf_counter()

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps({"config": CONFIG | fields, "results": results}, indent=1))

    profiled_runs = [(Path(tree), True) for tree in filter(None, args.profile_trees.split(","))]
    if profiled_runs and args.swa_tree:
        profiled_runs.append((args.swa_tree, False))
    for run in profiled_runs:
        tree, use_ssm_branch = run
        probe = Probe(use_ssm_branch, profile=True, steps=args.steps, compile=args.compile, fields=fields)
        label.setdefault(run, f"{tree.resolve().name}{'' if use_ssm_branch else ' (SSM off)'}")
        results.setdefault(label[run], {"steps_ms": [], "runs": []})["profile"] = profiled = run_tree(tree, probe)
        print(
            f"== {label[run]}: {profiled.get('host_syncs')} host syncs, {profiled.get('gpu_kernel_ms', 0):.1f} ms "
            f"of kernels in a {profiled.get('step_ms', 0):.1f} ms step\n{profiled.get('top_kernels', profiled)}",
            flush=True,
        )
        save()
    anchor_profile = results.get(label.get((args.swa_tree, False)), {}).get("profile", {}).get("kernel_gpu_ms")
    for run in profiled_runs[:-1] if anchor_profile else []:
        hybrid_profile = results[label[run]]["profile"].get("kernel_gpu_ms")
        if hybrid_profile:
            print(
                f"== what {label[run]}'s branch adds to the anchor's step, kernel by kernel\n"
                f"{kernel_differences(hybrid_profile, anchor_profile)}",
                flush=True,
            )
    for round_index in range(args.rounds):
        for run in runs if round_index % 2 == 0 else runs[::-1]:
            if time.perf_counter() - started > args.budget_s:
                break
            tree, use_ssm_branch = run
            result = run_tree(tree, Probe(use_ssm_branch, steps=args.steps, compile=args.compile, fields=fields))
            results[label[run]]["runs"].append(result)
            if "step_ms" in result:
                results[label[run]]["steps_ms"].append(result["step_ms"])
            compiled = (
                f" compiled in {result['compile_s']:.0f} s, {result['graph_breaks']} graph breaks "
                f"{result['graph_break_reasons']}"
                if "compile_s" in result
                else ""
            )
            print(
                f"round {round_index} {label[run]:22s} {result.get('step_ms', float('nan')):7.1f} ms  "
                f"(host issues it in {result.get('host_ms', float('nan')):6.1f} ms)  "
                f"peak {result.get('peak_gib', float('nan')):5.2f} GiB {result.get('error', '')}{compiled}",
                flush=True,
            )
            save()
    anchor_times = results[label[runs[-1]]]["steps_ms"] if args.swa_tree else []
    anchor = statistics.median(anchor_times) if anchor_times else None
    print(f"\n{'tree':24s} {'median of runs':>15s} {'runs':>30s} {'SSM-off / it':>13s}")
    for run in runs:
        times = results[label[run]]["steps_ms"]
        if not times:
            continue
        ratio = f"{anchor / statistics.median(times):.3f}x" if anchor else ""
        runs_text = " ".join(f"{t:.1f}" for t in times)
        print(f"{label[run]:24s} {statistics.median(times):12.1f} ms {runs_text:>30s} {ratio:>13s}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
