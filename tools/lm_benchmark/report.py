"""The report of saved results: the tables (loss by bucket, passkey, the gain from context older than 2W, the
share of the upcycled -> teacher gap that distillation closes) and the loss-by-position plot."""

from pathlib import Path

import numpy as np


def label(result: dict) -> str:
    """The model's name in tables and plots; a distillation that does not train everything says what it trained."""
    mode = result.get("distillation", {}).get("mode", "all")
    tag = result.get("tag")
    return result["model"] + (f" ({mode})" if mode != "all" else "") + (f" [{tag}]" if tag else "")


def print_table(results: list[dict]) -> None:
    buckets = list(results[0]["eval"]["loss_by_bucket"])
    passkeys = list(results[0]["eval"]["passkey"])
    header = [
        "model",
        "params",
        "tokens",
        "tok/s",
        "mean loss",
        *(f"loss {b}" for b in buckets),
        *(f"passkey {p}" for p in passkeys),
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        ev = r["eval"]
        tok_s = r["train"]["tokens_per_second"]
        row = [
            label(r),
            _count(r["parameters"]),
            _count(r["train"]["tokens"]),
            f"{tok_s:,}" if tok_s else "-",
            f"{ev['mean_loss']:.3f}",
            *(f"{ev['loss_by_bucket'][b]:.3f}" for b in buckets),
            *(f"{ev['passkey'][p]:.2f}" if p in ev["passkey"] else "-" for p in passkeys),
        ]
        print("| " + " | ".join(row) + " |")
    with_gain = [r for r in results if "context_beyond_2W" in r["eval"]]
    if with_gain:
        print(
            "\nloss with the whole file before each position / with at most its last 2W tokens (gain: the older part)"
        )
        buckets = list(with_gain[0]["eval"]["context_beyond_2W"])
        print("| model | " + " | ".join(buckets) + " |")
        print("|" + "---|" * (len(buckets) + 1))
        for r in with_gain:
            cells = [
                f"{g['whole_file']:.4f} / {g['last_2W']:.4f} (gain {g['gain']:+.4f})"
                for g in r["eval"]["context_beyond_2W"].values()
            ]
            print(f"| {label(r)} | " + " | ".join(cells) + " |")
    with_reset = [r for r in results if r["eval"].get("ssm_beyond_reset")]
    if with_reset:
        print(
            "\nloss at positions >= 2D, whole file / the SSM branch restarted D..2D tokens back (attention unchanged;"
        )
        print("gain: what the branch alone carries from beyond D)")
        distances = list(with_reset[0]["eval"]["ssm_beyond_reset"])
        print("| model | " + " | ".join(f"D = {d}" for d in distances) + " |")
        print("|" + "---|" * (len(distances) + 1))
        for r in with_reset:
            gains = r["eval"]["ssm_beyond_reset"]
            cells = [
                f"{gains[d]['whole_file']:.4f} / {gains[d]['ssm_reset']:.4f} (gain {gains[d]['gain']:+.4f})"
                if d in gains
                else "-"
                for d in distances
            ]
            print(f"| {label(r)} | " + " | ".join(cells) + " |")
    print_retrieval(results)
    print_retrieval(results, "retrieval_training_formats")
    print_repeated_bigrams(results)
    print_decision(results)
    print_gap_recovered(results)


def print_retrieval(results: list[dict], key: str = "retrieval") -> None:
    """Per distance, the value's log-probability per token with the assignment minus without it (nats: what the
    model retrieved); `key` "retrieval_training_formats": the probes drawn as the data lever's training pairs."""
    with_retrieval = [r for r in results if r["eval"].get(key)]
    if not with_retrieval:
        return
    distances = list(with_retrieval[0]["eval"][key])
    kind = " in the data lever's training formats" if key != "retrieval" else ""
    print(f"\ngraded retrieval{kind}: the value's log-prob per token with its assignment minus without (nats)")
    print("| model | " + " | ".join(distances) + " |")
    print("|" + "---|" * (len(distances) + 1))
    for r in with_retrieval:
        cells = [_retrieved(r, d, key) for d in distances]
        print(f"| {label(r)} | " + " | ".join(cells) + " |")


def print_repeated_bigrams(results: list[dict]) -> None:
    """At positions >= 2W, the loss on tokens by where their bigram last occurred."""
    with_bigrams = [r for r in results if r["eval"].get("repeated_bigrams")]
    if not with_bigrams:
        return
    classes = list(with_bigrams[0]["eval"]["repeated_bigrams"])
    print("\nloss at positions >= 2W by where the token's bigram last occurred (tokens counted in the first row)")
    first = with_bigrams[0]["eval"]["repeated_bigrams"]
    print("| model | " + " | ".join(f"{c} ({first[c]['tokens']:,})" for c in classes) + " |")
    print("|" + "---|" * (len(classes) + 1))
    for r in with_bigrams:
        cells = [_loss(r["eval"]["repeated_bigrams"][c]["loss"]) for c in classes]
        print(f"| {label(r)} | " + " | ".join(cells) + " |")


def print_decision(results: list[dict]) -> None:
    """The memory program's decision table, one row per hybrid: primary, the loss the SSM branch alone saves beyond
    2W (restarted 2W..4W back, at positions >= 4W) as a share of what full attention gains from context older than
    2W at [4W,16W); guard, the loss inside the window against the first hybrid row's (the baseline); retrieval at
    4W-16W; training tokens/s."""
    full = next((r for r in results if r["model"] == "full" and "context_beyond_2W" in r["eval"]), None)
    hybrids = [r for r in results if r["eval"].get("ssm_beyond_reset")]
    if not hybrids:
        return
    full_gain = full["eval"]["context_beyond_2W"].get("[4W,16W)", {}).get("gain") if full else None
    baseline = hybrids[0]["eval"]["loss_by_bucket"]["[0,W)"]
    far = [d for d in hybrids[0]["eval"].get("retrieval", {}) if d.split("W")[0] in ("4", "8", "16")]
    print(f"\ndecision table (full attention's gain from context older than 2W at [4W,16W): {_loss(full_gain)})")
    print(
        "| run | SSM gain beyond 2W | share of full's | loss [0,W) vs first row | "
        + " | ".join(f"retrieved {d}" for d in far)
        + " | tok/s |"
    )
    print("|" + "---|" * (5 + len(far)))
    for r in hybrids:
        gain = r["eval"]["ssm_beyond_reset"].get("2W", {}).get("gain")
        share = f"{gain / full_gain:.0%}" if gain is not None and full_gain else "-"
        guard = r["eval"]["loss_by_bucket"]["[0,W)"] - baseline
        cells = [_retrieved(r, d) for d in far]
        tok_s = r["train"]["tokens_per_second"]
        cells.append(f"{tok_s:,}" if tok_s else "-")
        print(f"| {label(r)} | {_loss(gain)} | {share} | {guard:+.4f} | " + " | ".join(cells) + " |")


def _retrieved(result: dict, distance: str, key: str = "retrieval") -> str:
    score = result["eval"].get(key, {}).get(distance)
    return "-" if score is None else f"{score['retrieved']:+.3f}"


def _loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_gap_recovered(results: list[dict]) -> None:
    """Per position bucket, the share of the gap between `upcycled` (its teacher's weights with the window) and its
    teacher `full` that each distilled model closes: 0 is the upcycled model's loss, 1 the teacher's."""
    by_model = {label(r): r["eval"]["loss_by_bucket"] for r in results}
    students = [label(r) for r in results if r["model"] in ("distilled", "distilled-swa")]
    if not ({"full", "upcycled"} <= set(by_model) and students):
        return
    teacher, start = by_model["full"], by_model["upcycled"]
    print("\nshare of the gap upcycled -> full (teacher) that distillation closes, by position bucket")
    print("| bucket | full | upcycled | " + " | ".join(students) + " |")
    print("|" + "---|" * (3 + len(students)))
    for bucket in teacher:
        gap = start[bucket] - teacher[bucket]
        cells = [
            f"{by_model[m][bucket]:.3f}" + (f" ({(start[bucket] - by_model[m][bucket]) / gap:.0%})" if gap > 0 else "")
            for m in students
        ]
        print(f"| {bucket} | {teacher[bucket]:.3f} | {start[bucket]:.3f} | " + " | ".join(cells) + " |")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def plot(results: list[dict], path: Path) -> None:
    """Loss against position (log x, the window marked) and, below, each model's loss minus the first model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, delta) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 2])
    reference = results[0]
    _, reference_loss = zip(*reference["eval"]["loss_curve"])
    for r in results:
        x, y = zip(*r["eval"]["loss_curve"])
        ax.plot(x, y, label=f"{label(r)} ({_count(r['parameters'])})")
        delta.plot(x, np.subtract(y, reference_loss))
    window = reference["shape"]["window"]
    # The first few positions (hardly any context) lie far above the rest: keep the scale for the rest.
    settled = [
        (x, y, y - y0) for r in results for (x, y), y0 in zip(r["eval"]["loss_curve"], reference_loss) if x >= 16
    ]
    _, losses, differences = zip(*settled)
    ax.set_ylim(min(losses) - 0.1, max(losses) + 0.3)
    delta.set_ylim(min(differences) - 0.05, max(differences) + 0.05)
    for axis in (ax, delta):
        axis.axvline(window, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    ax.text(window, ax.get_ylim()[1], " window W", va="top", color="grey")
    ax.set_xscale("log")
    ax.set_ylabel("next-token loss (nats)")
    delta.set_ylabel(f"minus {label(reference)}'s")
    delta.set_xlabel("position in the evaluation sequence (tokens)")
    corpus = reference["corpus"]
    ax.set_title(f"Held-out Python sources ({corpus['validation_files']} files, list {corpus['list_sha256'][:10]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def plot_decision(results: list[dict], path: Path) -> None:
    """The memory program's plot: left, graded retrieval (the value's log-prob with its assignment in context minus
    without) against the assignment's distance, one line per run; right, the loss the SSM branch alone saves beyond
    2W for each hybrid run, against full attention's gain from context older than 2W (the primary's denominator)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legend_rows = -(-len(results) // 4)  # the runs' legend goes under both panels, four to a row
    fig, (retrieval, share) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.2 * legend_rows), width_ratios=[3, 2])
    retrieval.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # up to 20 runs, no two lines in one colour
    for r in results:
        scores = r["eval"].get("retrieval") or {}
        # keys read "0.5W (128)" or "16W (4096) >T": the distance in windows comes first
        distances = [float(key.split("W")[0]) for key in scores]
        if distances:
            retrieval.plot(distances, [s["retrieved"] for s in scores.values()], marker="o", label=label(r))
    retrieval.axvline(1, color="grey", linestyle="--", linewidth=1)
    retrieval.axhline(0, color="black", linewidth=0.5)
    retrieval.set_xscale("log", base=2)
    ticks = sorted({float(key.split("W")[0]) for r in results for key in r["eval"].get("retrieval") or {}})
    retrieval.set_xticks(ticks, [f"{t:g}W" for t in ticks])
    retrieval.set_xlabel("distance from the assignment to its use (windows W)")
    retrieval.set_ylabel("log-prob gain of the value (nats)")
    retrieval.set_title("graded retrieval")
    retrieval.grid(alpha=0.3)

    hybrids = [r for r in results if r["eval"].get("ssm_beyond_reset")]
    gains = [r["eval"]["ssm_beyond_reset"].get("2W", {}).get("gain", float("nan")) for r in hybrids]
    share.bar(range(len(hybrids)), gains, color="tab:blue")
    share.set_xticks(range(len(hybrids)), [label(r) for r in hybrids], rotation=30, ha="right", fontsize=8)
    full = next((r for r in results if r["model"] == "full" and "context_beyond_2W" in r["eval"]), None)
    if full is not None:
        full_gain = full["eval"]["context_beyond_2W"]["[4W,16W)"]["gain"]
        share.axhline(full_gain, color="tab:red", linestyle="--", label=f"full attention: {full_gain:.4f}")
        share.axhline(full_gain / 2, color="tab:red", linestyle=":", label="the goal: half of it")
        share.legend(fontsize=8)
    share.axhline(0, color="black", linewidth=0.5)
    share.set_ylabel("loss saved beyond 2W (nats)")
    share.set_title("SSM branch alone, restarted 2W back")
    share.grid(alpha=0.3, axis="y")
    legend_height = 0.2 * legend_rows / fig.get_figheight() + 0.02
    fig.legend(*retrieval.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_height, 1, 1))
    fig.savefig(path, dpi=130)
