"""The worker process: one model in one vLLM engine, in-process, so that its scheduler is readable. The protocol:
the parent writes the spec to a JSON file and runs `python -m tools.serving_benchmark.worker SPEC`; the
worker prints its result as one `RESULT_JSON {...}` line."""

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from .engine import Engine
from .workloads import end_to_end, measure_point, point_plan, prefix_workload, random_prompts

# Each model runs on the model runner vLLM picks for it, whatever this process's environment says, except where its
# worker's environment (on top of this one's) asks otherwise.
RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
WORKER_ENV = {"hybrid-v2": {RUNNER_SWITCH: "1"}}

# Where the worker imports this package from: the parent's copy, installed or not.
IMPORT_ROOT = Path(__file__).resolve().parents[2]


def measure(spec: dict) -> dict:
    """What the worker process runs: one engine on `spec["model_dir"]`, warmed up, then the spec's workload (the
    points at every prompt length, or the end-to-end workloads, or the shared-prefix workload, or the profile
    tables)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its scheduler is readable
    engine = Engine(spec["model_dir"], spec["engine"])
    # Warm-up: compiles whatever kernels a first prefill and decode and the mixed batches compile, outside the timed
    # steps.
    engine.decode_run(random_prompts(2, spec["prompt_lens"][0], spec["vocab_size"], seed=0), 4, 12)
    largest_batch, _ = point_plan(
        min(spec["prompt_lens"]), spec["prefill_budget"], spec["max_num_seqs"], spec["max_num_batched_tokens"]
    )
    engine.warm_up(random_prompts(largest_batch, spec["window"] // 2, spec["vocab_size"], seed=11))
    if spec.get("prefix_only"):
        return {"prefix": prefix_workload(engine, spec)}
    if spec.get("profile"):
        length, vocab = spec["prompt_lens"][0], spec["vocab_size"]
        steps = min(32, spec["engine"]["max_model_len"] - length - 1)  # every step decodes (smoke lengths are short)
        decodes = {
            f"decode, batch {batch}": engine.profile_steps(random_prompts(batch, length, vocab, batch), steps, True)
            for batch in spec["profile"]
        }
        prefill = engine.profile_steps(random_prompts(32, length, vocab, 0), 16, after_prefill=False)
        return {"profile": decodes | {"first steps, batch 32": prefill}}
    points, workloads = [], []
    if spec.get("end_to_end"):
        for prompt_len, requests in spec["end_to_end"]:
            workloads.append(asdict(end_to_end(engine, spec["model"], prompt_len, requests, spec)))
            print(json.dumps(workloads[-1]), file=sys.stderr, flush=True)
    else:
        for prompt_len in spec["prompt_lens"]:
            points.append(asdict(measure_point(engine, spec["model"], prompt_len, spec)))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    # What vLLM settled on: the CUDA-graph mode once every backend declared its support (e.g. FULL_AND_PIECEWISE),
    # and the model runner.
    return {
        "points": points,
        "end_to_end": workloads,
        "cudagraph_mode": str(engine.vllm_config.compilation_config.cudagraph_mode),
        "model_runner": "V2" if engine.vllm_config.use_v2_model_runner else "V1",
    }


def run_worker(spec: dict, log_path: Path) -> dict:
    """Runs `measure(spec)` in a worker process (its output to `log_path`) and returns its result."""
    spec_path = log_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    inherited = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", RUNNER_SWITCH)}
    env = inherited | WORKER_ENV.get(spec["model"], {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(IMPORT_ROOT), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(spec_path)], stdout=log, stderr=log, env=env, check=False
        )
    for line in log_path.read_text().splitlines():
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON ") :])
    raise RuntimeError(f"the {spec['model']} worker failed (exit {done.returncode}); its log: {log_path}")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    print("RESULT_JSON " + json.dumps(measure(spec)), flush=True)


if __name__ == "__main__":
    main()
