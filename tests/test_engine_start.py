"""What a user's one script does before `LLM()`: build a model on the CPU, save it, convert it. vLLM then forks its
engine core and workers from that process (unless CUDA is initialised), so nothing of it may leave the process in a
state a fork cannot survive: no GPU driver touched, no OpenMP pool that the child's first parallel op waits on
forever. scripts/device_check.sh `startup` runs the whole flow into `LLM()` on the H200.

Each check runs in a fresh interpreter: the first parallel region or driver call of the test session must not be
someone else's."""

import subprocess
import sys
import textwrap

from conftest import REPO_ROOT

# A model whose initialisation runs PyTorch's parallel CPU loops (tensors beyond ATen's grain of 32768 elements),
# saved and converted in the process, as the README's flow does with a real one.
BUILD_SAVE_CONVERT = """
import sys
import torch
from configuration import HybridConfig
from modeling import HybridForCausalLM
from vllm_integration.convert import main as convert

torch.set_num_threads(2)
config = HybridConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16)
HybridForCausalLM(config).save_pretrained(f"{workdir}/hf")
HybridForCausalLM.from_pretrained(f"{workdir}/hf")
assert convert([f"{workdir}/hf", f"{workdir}/vllm", "--dtype", "bfloat16"]) == 0
"""


def run_script(script: str, workdir, timeout: float) -> subprocess.CompletedProcess:
    code = f"workdir = {str(workdir)!r}\n" + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_a_process_vllm_forks_after_building_a_model_runs_parallel_cpu_ops(tmp_path):
    """The engine's process, forked the way vLLM forks it (its own multiprocessing context, `fork` as its default),
    loads the converted weights and runs a parallel op on them, which waits forever on the parent's OpenMP pool
    without the plugin's fix (upstream_fixes, fix 4)."""
    script = (
        BUILD_SAVE_CONVERT
        + """
import os
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
import vllm_integration
from vllm.utils.system_utils import get_mp_context

vllm_integration.register()  # what vLLM's engine arguments do before the engine starts

def load_weights():
    from safetensors.torch import load_file
    weights = load_file(f"{workdir}/vllm/model.safetensors")
    embedding = weights["model.embed_tokens.weight"].float()  # 524,288 elements: a parallel loop
    assert torch.isfinite(embedding.exp()).all()

context = get_mp_context()
assert context.get_start_method() == "fork"
engine = context.Process(target=load_weights)
engine.start()
engine.join(60)
if engine.exitcode is None:
    engine.kill()
    sys.exit("the forked process hung in its first parallel op")
sys.exit(engine.exitcode)
"""
    )
    done = run_script(script, tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_building_saving_loading_and_converting_never_reach_the_gpu(tmp_path):
    """No CUDA initialisation, no device query, no Triton driver: each entry is replaced by a probe that records its
    call before the flow starts."""
    script = (
        """
import torch
import triton.runtime.driver

calls = []

def probe(name, original):
    def recorded(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    return recorded

for name in ("_lazy_init", "init", "is_available", "device_count", "get_device_properties",
             "get_device_capability", "current_device", "synchronize"):
    setattr(torch.cuda, name, probe(f"torch.cuda.{name}", getattr(torch.cuda, name)))
if hasattr(torch._C, "_cuda_getDeviceCount"):  # absent from CPU-only builds (torch 2.13+cpu)
    torch._C._cuda_getDeviceCount = probe("cudaGetDeviceCount", torch._C._cuda_getDeviceCount)
driver_class = type(triton.runtime.driver)
for name in ("active", "default"):
    setattr(driver_class, name, property(probe(f"triton.runtime.driver.{name}", getattr(driver_class, name).fget)))
"""
        + BUILD_SAVE_CONVERT
        + """
assert not calls, f"the flow reached the GPU through {sorted(set(calls))}"
assert not torch.cuda.is_initialized()
"""
    )
    done = run_script(script, tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
