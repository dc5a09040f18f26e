"""The report of saved runs: the table (with each hybrid against each baseline, vLLM's settings, profiles and
prefix caching) and the plot of throughput and bytes per sequence against prompt length."""

import itertools

from .checkpoints import HYBRIDS, MODELS

LABELS = {
    "hybrid": "hybrid (window + SSM)",
    "hybrid-v2": "hybrid (window + SSM)",  # the plot adds each run's model runner
    "hybrid-mamba2": "hybrid (window + Mamba-2 SSM)",
    "swa": "sliding window only (Mistral-style)",
    "swa-matched": "sliding window only, MLP widened to the hybrid's parameters",
    "llama": "full attention (Llama)",
}


def run_key(entry: dict) -> tuple[str, int]:
    """(model, tensor-parallel size) of a point or workload; runs saved before the option were at TP 1."""
    return entry["model"], entry.get("tensor_parallel_size", 1)


def run_label(entry: dict) -> str:
    """A point's or workload's model, with its tensor-parallel size when above 1 ("hybrid-v2 TP 2")."""
    model, tp = run_key(entry)
    return model if tp == 1 else f"{model} TP {tp}"


def ordered_labels(entries: list[dict]) -> list[str]:
    """The run labels of `entries`, models in MODELS' order, each model's tensor-parallel sizes ascending."""
    runs = {run_key(e): run_label(e) for e in entries}
    return [runs[key] for key in sorted(runs, key=lambda key: (MODELS.index(key[0]), key[1]))]


def compared_pairs(entries: list[dict], baselines: tuple[str, ...]) -> list[tuple[str, str]]:
    """(label, label) pairs to compare: each hybrid against each baseline at the same tensor-parallel size, and each
    model at a tensor-parallel size above 1 against itself at 1."""
    runs = {run_key(e): run_label(e) for e in entries}
    pairs = [
        (runs[h, tp], runs[b, tp])
        for (h, tp), b in itertools.product(sorted(runs), baselines)
        if h in HYBRIDS and (b, tp) in runs
    ]
    return pairs + [(label, runs[m, 1]) for (m, tp), label in sorted(runs.items()) if tp > 1 and (m, 1) in runs]


def table(results: list[dict]) -> str:
    points = [p for r in results for p in r["points"]]
    by = {(run_label(p), p["prompt_len"]): p for p in points}
    header = [
        "| prompt | model | batch (capacity) | output tok/s | TPOT batch 1 (ms) | KV+state MiB/seq | prefill tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines = header if points else []  # an end-to-end run has no points
    labels = ordered_labels(points)
    for prompt_len in sorted({p["prompt_len"] for p in points}):
        for model in labels:
            if p := by.get((model, prompt_len)):
                partial = "" if p["min_step_tokens"] == p["batch"] else f" (INVALID: {p['min_step_tokens']}/step)"
                lines.append(
                    f"| {prompt_len:,} | {model} | {p['batch']} ({p['capacity']:,}) | {p['decode_tok_s']:,.0f}"
                    f"{partial} | {p['tpot_ms']:.2f} | {p['bytes_per_seq'] / 2**20:,.1f} | {p['prefill_tok_s']:,.0f} |"
                )
    ratios = []
    for prompt_len in sorted({p["prompt_len"] for p in points}):
        for name, base in compared_pairs(points, ("llama", "swa")):
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
    return "\n".join(lines + [""] + end_to_end_table(results) + ratios)


def end_to_end_table(results: list[dict]) -> list[str]:
    """Wall time of each end-to-end workload per model, and each hybrid's speed against each baseline's."""
    entries = [w for r in results for w in r.get("end_to_end", [])]
    runs = {(run_label(w), w["prompt_len"], w["requests"]): w for w in entries}
    if not runs:
        return []
    workloads = sorted({(length, requests) for _, length, requests in runs})
    models = ordered_labels(entries)
    pairs = compared_pairs(entries, ("swa", "swa-matched", "llama"))
    lines = [
        "| workload | " + " | ".join(models) + "".join(f" | {h} / {b}" for h, b in pairs) + " |",
        "|---|" + "---:|" * (len(models) + len(pairs)),
    ]
    for length, requests in workloads:
        cells = [runs.get((m, length, requests)) for m in models]
        times = [f"{w['seconds']:.2f} s" if w else "-" for w in cells]
        speed = {m: w["output_tok_s"] for m, w in zip(models, cells) if w}
        ratios = [f"{speed[h] / speed[b]:.2f}x" if h in speed and b in speed else "-" for h, b in pairs]
        output_len = next(w["output_len"] for w in cells if w)
        lines.append(f"| {length:,} x {requests} (+{output_len} out) | " + " | ".join(times + ratios) + " |")
    return lines + [""]


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
