"""Language modelling on real text, beyond the window: the hybrid against sliding-window and full attention; see
tools/lm_benchmark/ (or `--help`).

    python scripts/bench_lm.py --models hybrid --train-seconds 330      # steps picked from a time budget
    python scripts/bench_lm.py --report R1.json R2.json R3.json --plot lm.png
    python scripts/bench_lm.py --smoke                                  # the whole pipeline on CPU, tiny
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.lm_benchmark.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
