"""Times this tree's kernels against another tree's in one lease: the two trees' own `scripts/bench_kernels.py` run in
turn, each run a fresh process, in ABBA order round after round, so that whatever drifts during a lease (clocks,
temperature, what ran before) falls on both alike. The other tree is any checkout, e.g. an older commit:

    git archive REV modeling configuration scripts tools vllm_integration | tar -x -C outputs/base
    python3 scripts/bench_ab.py --base outputs/base --rounds 3 --only conv,prefill,train --json $OUT/ab.json
    python3 scripts/bench_ab.py --base outputs/base --timer cudagraph --only conv

Arguments this script does not know go to both trees' bench_kernels.py. The timer (--timer) is the one every
`median_ms` of bench_kernels.py runs with; the training step times itself (wall clock of whole steps) whatever it is:
    events     triton.testing.do_bench, bench_kernels.py's own: CUDA events around each call, L2 flushed in between
    cudagraph  triton.testing.do_bench_cudagraph: the calls replayed from a CUDA graph, no host work in the time
               (a row whose work cannot be captured, a host sync, reads nan)
    host       the host's wall time per call alone: calls queued without synchronizing
A row slower under `events` but not under `cudagraph`, with a larger `host` time, is host-bound.
"""

import argparse
import json
import math
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cudagraph_ms(fn, rep=300, **_) -> float:
    import torch
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as error:  # noqa: BLE001 -- a row that cannot be captured reads nan; the others still run
        print(f"[bench_ab] not capturable, nan: {type(error).__name__}: {str(error)[:300]}", flush=True)
        torch.cuda.synchronize()
        return math.nan


def host_ms(fn, **_) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    torch.cuda.synchronize()
    calls = max(1, min(100, int(0.02 / max(once, 1e-6))))  # ~20 ms of host work, far from filling the launch queue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls


TIMERS = {"cudagraph": cudagraph_ms, "host": host_ms}


def run_worker(tree: Path, timer: str, bench_args: list[str]) -> None:
    """Runs `tree`'s bench_kernels.py in this process with `timer` in place of triton.testing.do_bench."""
    if timer != "events":
        import triton.testing

        triton.testing.do_bench = TIMERS[timer]
    script = tree / "scripts" / "bench_kernels.py"
    sys.argv = [str(script), *bench_args]
    runpy.run_path(str(script), run_name="__main__")


def bench_once(tree: Path, timer: str, bench_args: list[str], log: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result_json = Path(tmp) / "rows.json"
        command = [sys.executable, __file__, "--worker", str(tree), "--timer", timer, "--", *bench_args]
        with log.open("w") as log_file:
            status = subprocess.run(
                [*command, "--json", str(result_json)],
                cwd=tree,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode
        if status or not result_json.exists():
            print(f"[bench_ab] {tree} failed (exit {status}), log: {log}", flush=True)
            return []
        return json.loads(result_json.read_text())["rows"]


def compare(runs: dict[str, list[list[dict]]], labels: tuple[str, str]) -> list[dict]:
    """One entry per row of either tree: each run's time, the medians, and this tree's over the base's."""
    times: dict[tuple, dict[str, list[float]]] = {}
    for label in labels:
        for rows in runs[label]:
            for row in rows:
                key = (row["section"], row["variant"], row["shape"])
                times.setdefault(key, {name: [] for name in labels})[label].append(row["ms"])
    table = []
    for (section, variant, shape), by_tree in times.items():
        medians = {label: statistics.median(ms) if ms else math.nan for label, ms in by_tree.items()}
        base, this = (medians[label] for label in labels)
        table.append(
            {
                "section": section,
                "variant": variant,
                "shape": shape,
                "runs_ms": by_tree,
                "median_ms": medians,
                "ratio": this / base if base else math.nan,
            }
        )
    return table


def format_table(table: list[dict], labels: tuple[str, str], timer: str) -> str:
    lines = [
        f"| row ({timer}, medians) | {labels[0]} ms | {labels[1]} ms | {labels[1]} / {labels[0]} | runs |",
        "|---|---:|---:|---:|---|",
    ]
    for entry in table:
        runs = "; ".join(f"{label} " + " ".join(f"{ms:.4g}" for ms in entry["runs_ms"][label]) for label in labels)
        base, this = (entry["median_ms"][label] for label in labels)
        lines.append(
            f"| {entry['section']}: {entry['variant']}, {entry['shape']} | {base:.4g} | {this:.4g} | "
            f"{entry['ratio']:.3f} | {runs} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="the other tree (its scripts/bench_kernels.py is run)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree (ABBA order)")
    parser.add_argument("--timer", choices=["events", *TIMERS], default="events")
    parser.add_argument("--json", type=Path, help="write every run's rows and the comparison here")
    parser.add_argument("--log-dir", type=Path, default=Path("outputs/bench_ab"), help="each run's output")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args, bench_args = parser.parse_known_args()
    if bench_args[:1] == ["--"]:
        bench_args = bench_args[1:]
    if args.worker is not None:
        run_worker(args.worker, args.timer, bench_args)
        return
    if args.base is None or not (args.base / "scripts" / "bench_kernels.py").is_file():
        sys.exit(f"--base must be a tree with scripts/bench_kernels.py, got {args.base}")
    if args.rounds < 1:
        sys.exit(f"--rounds must be >= 1, got {args.rounds}")
    trees = {"base": args.base.resolve(), "this": REPO}
    labels = ("base", "this")
    log_dir = args.log_dir.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {label: [] for label in labels}
    for round_index in range(args.rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            start = time.perf_counter()
            log = log_dir / f"{args.timer}-{label}-{round_index}.log"
            runs[label].append(bench_once(trees[label], args.timer, bench_args, log))
            print(f"[bench_ab] round {round_index} {label}: {time.perf_counter() - start:.0f} s", flush=True)
    table = compare(runs, labels)
    print(format_table(table, labels, args.timer))
    if args.json:
        payload = {"trees": {label: str(path) for label, path in trees.items()}, "timer": args.timer, "runs": runs}
        args.json.write_text(json.dumps(payload | {"comparison": table}, indent=1))


if __name__ == "__main__":
    main()
