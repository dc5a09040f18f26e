"""Every Triton kernel of the project through the real compiler for sm_90 (tests/compile_for_hopper.py), on any
machine: the kernel tests run in Triton's interpreter on CPU machines, which does not type-check a kernel."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def project_kernels() -> set[str]:
    """The names of the kernels the sources define: `def _..._kernel(` right under a `@triton.jit` decorator (which
    may span lines)."""
    names = set()
    for package in ("modeling", "vllm_integration"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            for match in re.finditer(r"^def (_\w+_kernel)\(", text, re.MULTILINE):
                decorator = text[: match.start()].rsplit("\n\n", 1)[-1]  # the lines since the last blank one
                if "@triton.jit" in decorator:
                    names.add(match.group(1))
    return names


def test_every_kernel_compiles_for_hopper():
    """Each kernel the sources define compiles down to an sm_90 cubin in at least one real call path (the script
    exits non-zero on the first failure), and the script's cases leave none of them out."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "compile_for_hopper.py")],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    compiled = set(re.findall(r"^COMPILED (\w+)$", done.stdout, re.MULTILINE))
    kernels = project_kernels()
    assert len(kernels) >= 10, f"the kernel scan found only {sorted(kernels)}"
    assert compiled == kernels, f"not compiled: {sorted(kernels - compiled)}; unknown: {sorted(compiled - kernels)}"
