"""Host-side work of the SSM branch: by default one branch's training step (forward + backward of `Mamba1Branch`
alone), on the fused op (`mamba_inner_fn`, one autograd node) and on the module path (forced by a no-op hook on
x_proj, as an adapter would); with `--ssm-type mamba2` the same for `Mamba2Branch` on its kernels (`mamba2_inner_fn`,
and the module path through a hook on the conv, the gated norm on its kernels as on CUDA), beside the Mamba-1 branch
of the same width; with `--decode`, one cached decode step of the
whole model as `generate()` runs it with the dynamic cache, the hybrid with its branch step as one op
(`mamba_inner_step`) and through its modules, and with the Mamba-2 branch, against Transformers' Mistral of the same
shapes (`bench_generate.py --shape small`, narrowed to `--hidden`). Reported: aten ops dispatched, autograd nodes
recorded (training), Triton launches, and the host time per step.

On a GPU the time is the host's alone: the step is issued and timed without waiting for the GPU (each repeat
synchronises once at its end, outside the timed loop's per-step cost, which is averaged over `--steps` steps).
On a CPU machine the kernels run in Triton's interpreter; `--stub-kernels` replaces every launch by a no-op so that
what is timed is the branch's own Python and aten work (the interpreter's is not a GPU launcher's cost).

    python scripts/bench_host_work.py                      # GPU: the issue-36 probe's layer width (hidden 1024, E 2048)
    TRITON_INTERPRET=1 python scripts/bench_host_work.py --stub-kernels --hidden 64 --seq-len 200
    TRITON_INTERPRET=1 python scripts/bench_host_work.py --stub-kernels --hidden 64 --seq-len 200 --ssm-type mamba2
    TRITON_INTERPRET=1 python scripts/bench_host_work.py --decode --stub-kernels --hidden 64 [--static-graph|--ablate]
"""

import argparse
import collections
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages, installed or not


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def autograd_nodes(output: torch.Tensor) -> int:
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def triton_launchers() -> tuple[tuple[type, str], ...]:
    """The methods every Triton launch goes through: the interpreter's (CPU) and the compiled kernels' (GPU). The
    interpreter's, before it binds the arguments: binding them for its grid executor took ~0.2 of the ~1.6 ms
    measured per Mamba-1 branch step, and a GPU never runs it."""
    from triton.runtime import interpreter, jit

    return (interpreter.InterpretedFunction, "run"), (jit.JITFunction, "run")


def stub_triton_launches() -> None:
    """Every Triton launch from now on does nothing: what is left to time is the host work around the launches."""
    for cls, method in triton_launchers():
        setattr(cls, method, lambda self, *args, **kwargs: None)


@contextlib.contextmanager
def counting_triton_launches(launches: collections.Counter):
    """Counts the Triton launches made inside the block, each run outside the op counter (the interpreter's own
    tensor copies are not the branch's ops). Only there: the timed steps run the launchers unwrapped."""
    originals = [(cls, method, getattr(cls, method)) for cls, method in triton_launchers()]
    for cls, method, original in originals:

        def launch(self, *args, _original=original, **kwargs):
            launches[getattr(self, "fn", self).__name__] += 1
            with _disable_current_modes():
                return _original(self, *args, **kwargs)

        setattr(cls, method, launch)
    try:
        yield
    finally:
        for cls, method, original in originals:
            setattr(cls, method, original)


def python_profile(step, steps: int, top: int) -> str:
    """cProfile's table of the `top` functions with the most own time over `steps` calls of `step`. Profiling slows
    Python code more than C calls: read it for where the host's time goes, not for how much there is."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    table = io.StringIO()
    pstats.Stats(profiler, stream=table).sort_stats("tottime").print_stats(top)
    print(table.getvalue())
    return table.getvalue()


def timed_steps(step, args, device: str, repeats: int | None = None) -> list[float]:
    """Milliseconds per call of `step`, one figure per repeat of `args.steps` calls (host time on a GPU);
    `args.repeats` repeats unless given."""
    times = []
    for _ in range(args.repeats if repeats is None else repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        times.append((time.perf_counter() - start) / args.steps * 1e3)
        if device == "cuda":
            torch.cuda.synchronize()
    return times


def decode_host_work(args, device: str) -> dict:
    """One cached decode step of the whole model, batch `args.batch` after a 64-token prompt, for the hybrid on its
    branch step (`fused`), the hybrid through its modules (`modules`: a no-op hook on every x_proj), the hybrid with
    the Mamba-2 branch (`mamba2`: its conv update, state update and gated norm) and Mistral; with `--ablate`, the
    hybrid with every branch reduced to nothing (`no branch`) and to its in_proj (`in_proj`)."""
    from bench_generate import SHAPES, build_models

    shape = dict(
        SHAPES["small"], hidden_size=args.hidden, intermediate_size=11 * args.hidden // 4,
        ssm_intermediate_size=args.hidden, window=min(SHAPES["small"]["window"], 64),
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prompt_len, max_len = 64, 64 + args.steps * (args.repeats + 2)  # the prompt, then every step of every path
    models = build_models(shape, max_len, device, dtype, names=("hybrid", "swa", "hybrid-mamba2"))
    layers = models["hybrid"].config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, shape["vocab_size"], (args.batch, prompt_len), generator=generator).to(device)
    # generate() passes the growing 2D attention mask with every step (all ones here: no padding)
    mask = torch.ones(args.batch, max_len, dtype=torch.long, device=device)
    paths = (("fused", "hybrid"), ("modules", "hybrid"), ("mamba2", "hybrid-mamba2"), ("mistral", "swa"))
    if args.ablate:
        paths += (("no branch", "hybrid"), ("in_proj", "hybrid"))

    def ablated(branch, path: str):
        """The branch's forward reduced to nothing (its caller's output returned as is) or to its in_proj alone."""

        def forward(hidden_states, past_key_values=None, padding_mask=None, seq_idx=None, add_to=None):
            if path == "in_proj":
                branch.in_proj(hidden_states)
            return add_to

        return forward

    @contextlib.contextmanager
    def on_path(path: str, model):
        """The `modules` path: a no-op hook on every x_proj for the block; the ablations: every branch's forward
        replaced (`ablated`); the others as they are."""
        on_branches = path in ("modules", "no branch", "in_proj")
        branches = [layer.self_attn.ssm for layer in model.model.layers] if on_branches else []
        hooks = [branch.x_proj.register_forward_hook(lambda *a: None) for branch in branches if path == "modules"]
        for branch in branches if path in ("no branch", "in_proj") else ():
            branch.forward = ablated(branch, path)
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for branch in branches:
                branch.__dict__.pop("forward", None)

    # Each path on its own cache; the paths timed in turn, one repeat each, the order reversed every other round, so
    # that the host's drift during the run (its clock, the processes beside it) falls on all of them alike.
    steps, counts, times = {}, {}, {path: [] for path, _ in paths}
    with torch.inference_mode():
        for path, name in paths:
            model = models[name]
            out = model(prompt, attention_mask=mask[:, :prompt_len], use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

            def step(model=model, cache=cache, token=token):
                length = cache.get_seq_length() + 1
                model(token, attention_mask=mask[:, :length], past_key_values=cache, use_cache=True)

            steps[path] = step
            with on_path(path, model):
                step()
                launches, counter = collections.Counter(), CountOps()
                with counting_triton_launches(launches), counter:
                    step()
            counts[path] = (launches, counter)
        for round_ in range(args.repeats):
            for path, name in paths if round_ % 2 == 0 else paths[::-1]:
                with on_path(path, models[name]):
                    times[path] += timed_steps(steps[path], args, device, repeats=1)
    results = {}
    for path, name in paths:
        model = models[name]
        with on_path(path, model):
            with torch.inference_mode():
                profile = python_profile(steps[path], args.steps, args.python_profile) if args.python_profile else None
            if args.static_graph:
                results[path + "_static_graph"] = static_graph_launches(model, prompt, device)
                print(f"{path:8s} static-cache step under Inductor: {results[path + '_static_graph']}")
        launches, counter = counts[path]
        aten_ops = sum(counter.ops.values())
        results[path] = {
            "aten_ops": aten_ops,
            "aten_ops_per_layer": round(aten_ops / layers, 2),
            "triton_launches_per_layer": round(sum(launches.values()) / layers, 2),
            "host_ms_median": round(statistics.median(times[path]), 4),
            "host_ms": [round(t, 4) for t in times[path]],
            "ops_per_layer": {op: round(n / layers, 2) for op, n in counter.ops.most_common()},
        }
        if profile is not None:
            results[path]["python_profile"] = profile
        print(
            f"{path:8s} aten ops {aten_ops:5d} ({aten_ops / layers:6.2f} a layer)  Triton launches "
            f"{results[path]['triton_launches_per_layer']:.0f} a layer  host {results[path]['host_ms_median']:.3f} ms "
            f"per step (median of {args.repeats} x {args.steps}, the paths interleaved)"
        )
    mistral = results["mistral"]["host_ms_median"]
    print(
        "host work a step / Mistral's:",
        {path: round(results[path]["host_ms_median"] / mistral, 3) for path, _ in paths},
    )
    if device == "cuda" and not args.stub_kernels:
        results["launch_costs"] = launch_costs(models["hybrid"], args)
        print("launch costs (us a call):", json.dumps(results["launch_costs"]))
    return results


def launch_costs(model, args) -> dict:
    """CUDA only: where a Triton launch's host time goes, on the Mamba-1 decode step's two launches (layer 0's weights,
    `args.batch` rows): the whole op (`mamba_inner_step`: its checks, its allocations and both launches), each launch
    through Triton's `kernel[grid](...)` (binding, specialisation key, cache lookup, then the compiled launcher), and
    through the compiled launcher alone (`CompiledKernel[grid]`: what a launcher bound once per specialisation would
    call), beside one small aten op for scale. Microseconds a call of host time, median of `args.repeats` repeats of
    200 calls."""
    from triton.runtime import driver, jit

    from modeling.ops.mamba_inner.interface import mamba_inner_step

    ssm = model.model.layers[0].self_attn.ssm
    width, dtype = ssm.conv1d.weight.shape[-1], ssm.in_proj.weight.dtype
    xz = torch.randn(args.batch, 1, 2 * ssm.intermediate_size, device="cuda", dtype=dtype)
    conv_state = torch.randn(args.batch, ssm.intermediate_size, width - 1, device="cuda", dtype=dtype)
    ssm_state = torch.randn(args.batch, ssm.intermediate_size, ssm.state_size, device="cuda")

    def op():
        mamba_inner_step(xz, ssm.conv1d.weight, ssm.conv1d.bias, ssm.x_proj.weight, ssm.dt_proj.weight,
                         ssm.dt_proj.bias, ssm.A_log, ssm.D, conv_state, ssm_state)  # fmt: skip

    recorded, run = [], jit.JITFunction.run

    def recording_run(self, *launch_args, grid, warmup, **launch_kwargs):
        kernel = run(self, *launch_args, grid=grid, warmup=warmup, **launch_kwargs)
        recorded.append((self, launch_args, launch_kwargs, grid, kernel))
        return kernel

    jit.JITFunction.run = recording_run
    try:
        op()
    finally:
        jit.JITFunction.run = run

    def per_call_us(call) -> float:
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                call()
            times.append((time.perf_counter() - start) / 200 * 1e6)
            torch.cuda.synchronize()
        return round(statistics.median(times), 2)

    costs = {"mamba_inner_step": per_call_us(op), "aten add": per_call_us(lambda: torch.add(xz, xz))}
    device = driver.active.get_current_device()
    for fn, launch_args, launch_kwargs, grid, kernel in recorded:
        bound_args = fn.device_caches[device][4](*launch_args, **launch_kwargs)[0]  # the binder's bound arguments
        grid = grid(bound_args) if callable(grid) else grid
        grid = (*grid, *(1,) * (3 - len(grid)))
        name = fn.fn.__name__
        costs[f"{name} kernel[grid]"] = per_call_us(lambda: fn[grid](*launch_args, **launch_kwargs))
        costs[f"{name} CompiledKernel[grid]"] = per_call_us(lambda: kernel[grid](*bound_args.values()))
    return costs


def static_graph_launches(model, prompt: torch.Tensor, device: str) -> dict:
    """What Inductor makes of one static-cache decode step (generate()'s compiled step, fullgraph), per layer: the
    kernels it generates (fused elementwise and reductions), and the calls it leaves to others, each a launch of its
    own: GEMMs (linear, and addmm: a branch's out_proj with the sum it adds), attention (sdpa) and this project's
    custom ops (two Triton launches for `mamba_inner_step`, three for `mamba2_inner_step`, one for each other). On a
    CPU machine Inductor's C++ backend splits a step into more kernels than its Triton backend does (its totals are
    not a GPU's): read the differences between the models, not the totals."""
    from torch._inductor import metrics
    from torch._inductor.compile_fx import compile_fx
    from transformers import StaticCache

    from modeling import HybridForCausalLM, HybridStaticCache

    length = prompt.shape[1]
    static = HybridStaticCache if isinstance(model, HybridForCausalLM) else StaticCache
    cache = static(config=model.config, max_cache_len=length + 8)
    mask = torch.ones(prompt.shape[0], length + 1, dtype=torch.long, device=device)
    positions = torch.full((prompt.shape[0], 1), length, device=device)
    calls = collections.Counter()

    def counting_inductor(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function":
                calls[getattr(node.target, "__name__", str(node.target))] += 1
        return compile_fx(graph_module, example_inputs)

    with torch.inference_mode():
        model(prompt, attention_mask=mask[:, :length], past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        metrics.reset()
        step = torch.compile(model.forward, fullgraph=True, backend=counting_inductor)
        step(prompt[:, -1:], attention_mask=mask, past_key_values=cache, position_ids=positions, use_cache=True)
    layers = model.config.num_hidden_layers
    custom_ops = ("mamba_inner_step", "mamba2_inner_step", "causal_conv1d_update", "selective_state_update",
                  "ssd_state_update")  # fmt: skip
    custom = {name: n for name, n in calls.items() if name in custom_ops}
    return {
        "generated_kernels_per_layer": round(metrics.generated_kernel_count / layers, 2),
        "gemms_per_layer": round((calls["linear"] + calls["addmm"]) / layers, 2),
        "attention_per_layer": round(calls["scaled_dot_product_attention"] / layers, 2),
        "custom_ops_per_layer": {name: round(n / layers, 2) for name, n in custom.items()},
    }


def training_paths(ssm_type: str) -> dict:
    """The ways to run a branch's training step that are compared, each as a function that sets the branch up for it
    and returns what undoes that. Mamba-1: the fused op, and the module path (a no-op hook on x_proj, as an adapter
    makes). Mamba-2 (on its kernels here): the fused op, and the module path (a hook on the conv) with the gated
    norm's kernels as on CUDA, on any device."""
    from modeling.history import mamba2
    from modeling.ops.ssd.gated_norm import gated_rms_norm

    def module_path(ssm):
        ssm.norm.forward = lambda y, z, norm=ssm.norm: gated_rms_norm(y, z, norm.weight, norm.group_size, norm.eps)
        hook = ssm.conv1d.register_forward_hook(lambda *a: None)

        def undo():
            del ssm.norm.forward
            hook.remove()

        return undo

    if ssm_type == "mamba2":
        assert mamba2.mamba2_inner_fn is not None, "the Mamba-2 kernels need Triton"
        return {"mamba2 fused": lambda ssm: lambda: None, "mamba2 modules": module_path}
    return {
        "fused": lambda ssm: lambda: None,
        "modules": lambda ssm: ssm.x_proj.register_forward_hook(lambda *a: None).remove,
    }


def branch_training_host_work(args, device: str) -> dict:
    """One branch's training step, forward and backward, `args.batch` x `args.seq_len` tokens, on each path of
    `training_paths`: aten ops, autograd nodes, Triton launches and host time. With `--ssm-type mamba2`, the Mamba-1
    branch of the same width first, its anchor."""
    from configuration import HybridConfig
    from modeling import HybridForCausalLM

    heads = max(1, args.hidden // 64)
    results = {}
    for ssm_type in ("mamba1",) if args.ssm_type == "mamba1" else ("mamba1", "mamba2"):
        fields = {"ssm_state_size": args.state_size} if args.state_size and ssm_type == args.ssm_type else {}
        config = HybridConfig(
            vocab_size=128, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64, sliding_window=64,
            ssm_type=ssm_type, **fields,
        )  # fmt: skip
        ssm = HybridForCausalLM(config).model.layers[0].self_attn.ssm.to(device, torch.bfloat16).train()
        hidden = torch.randn(args.batch, args.seq_len, args.hidden, device=device, dtype=torch.bfloat16)
        hidden.requires_grad_()
        grad = torch.randn(args.batch, args.seq_len, ssm.out_proj.out_features, device=device, dtype=torch.bfloat16)

        def step(ssm=ssm, hidden=hidden, grad=grad):
            for param in ssm.parameters():
                param.grad = None
            hidden.grad = None
            ssm(hidden).backward(grad)

        for path, set_up in training_paths(ssm_type).items():
            undo = set_up(ssm)
            step()
            step()
            times = timed_steps(step, args, device)
            profile = python_profile(step, args.steps, args.python_profile) if args.python_profile else None
            for param in ssm.parameters():
                param.grad = None
            launches, counter = collections.Counter(), CountOps()
            with counting_triton_launches(launches), counter:
                out = ssm(hidden)
                nodes = autograd_nodes(out)
                out.backward(grad)
            results[path] = {
                "state_size": config.ssm_state_size,
                "aten_ops": sum(counter.ops.values()),
                "autograd_nodes": nodes,
                "triton_launches": sum(launches.values()),
                "host_ms_median": round(statistics.median(times), 4),
                "host_ms": [round(t, 4) for t in times],
                "ops": dict(counter.ops.most_common()),
            }
            if profile is not None:
                results[path]["python_profile"] = profile
            undo()
            print(
                f"{path:18s} N {config.ssm_state_size:3d}  aten ops {results[path]['aten_ops']:4d}  autograd nodes "
                f"{nodes:3d}  Triton launches {results[path]['triton_launches']:2d}  host "
                f"{results[path]['host_ms_median']:.3f} ms per step (median of {args.repeats} x {args.steps})"
            )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=None, help="rows: 2 for the training step, 8 for --decode")
    parser.add_argument("--seq-len", type=int, default=512, help="short: the GPU must not be the bound")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stub-kernels", action="store_true", help="skip every Triton launch (host work alone)")
    parser.add_argument(
        "--python-profile", type=int, default=0, metavar="K",
        help="also profile each path's host work with cProfile and print its K costliest functions by own time (the "
        "Triton launcher's binding and key building, torch's ops, this project's launch helpers)",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="store_true",
        help="a cached decode step of the whole model (hybrid fused and through its modules, Mistral) instead of the "
        "branch's training step; --batch is then the number of rows (8 unless given)",
    )  # fmt: skip
    parser.add_argument(
        "--ablate", action="store_true",
        help="with --decode: also the hybrid with every branch's forward reduced to nothing (`no branch`) and to its "
        "in_proj alone (`in_proj`): how much of the step's host work beyond Mistral's the branch call is",
    )  # fmt: skip
    parser.add_argument(
        "--static-graph", action="store_true",
        help="with --decode: also count the launches of each model's static-cache step compiled by Inductor",
    )  # fmt: skip
    parser.add_argument(
        "--ssm-type", choices=("mamba1", "mamba2"), default="mamba1",
        help="the training step of this branch (mamba2: beside the Mamba-1 branch of the same width)",
    )  # fmt: skip
    parser.add_argument("--state-size", type=int, help="the --ssm-type branch's N (default: the config's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    from modeling.history import mamba1, mamba2

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # the host work of one issuing thread, as on a GPU
    if args.stub_kernels:
        stub_triton_launches()
    # The kernels on CPU too (in the interpreter, or stubbed), the Mamba-2 branch's gated norm module included (it
    # picks its kernels for CUDA tensors by itself)
    mamba1.Mamba1Branch._ops_for = lambda self, hidden: mamba1.KERNEL_OPS
    mamba2.Mamba2Branch._on_kernels = lambda self, hidden: True
    mamba2.Mamba2GatedRMSNorm.forward = lambda self, y, z: mamba2.gated_rms_norm(
        y, z, self.weight, self.group_size, self.eps
    )
    if args.decode:
        args.batch = args.batch or 8
        results = decode_host_work(args, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "device": device, "results": results}, f, indent=1)
        return 0
    args.batch = args.batch or 2
    results = branch_training_host_work(args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
