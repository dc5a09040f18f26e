"""What a benchmark records about the code it ran."""

import subprocess
from pathlib import Path


def head_commit() -> str:
    """The short hash of this checkout's HEAD, or "unknown" where there is no git (the device tool's copy of the tree
    may have none, or one that lags behind what it sends: benchmarks take `--commit` there)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
