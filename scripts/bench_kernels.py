"""Builds, checks and times every Triton kernel of the hybrid on one GPU, in one run, beside what a user would
otherwise run (the PyTorch references, flex_attention and SDPA, separate launches, vLLM's own kernels when vLLM is
importable), and against the two ceilings measured in the same run: a device-to-device copy and a bf16 matmul.

    python scripts/bench_kernels.py                       # everything, prints the table last
    python scripts/bench_kernels.py --only scan,decode    # some sections
    python scripts/bench_kernels.py --json $OUT/bench.json

Each row: median time over repeated runs (`triton.testing.do_bench`, CUDA events), the bytes or FLOPs the work must
move or do at the least, the rate that gives, and its share of the measured ceiling. Before timing, every kernel's
output is compared with its reference on fresh random inputs (`rel err` = ||out - ref|| / ||ref||, reference in
fp32). Results and commentary: BENCHMARKS.md.
"""

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bisect_train_step import CONFIG as TRAIN_STEP_CONFIG  # (one probe)
from bisect_train_step import step_times_ms, training_step

from modeling.ops.triton_utils import interpreter_bf16_dot

DEVICE = "cuda"


@dataclass
class Row:
    section: str
    variant: str
    shape: str
    ms: float
    bytes: float = 0.0  # the fewest bytes the work must move (0: not a memory-bound row)
    flops: float = 0.0  # the FLOPs it must do (0: not a compute-bound row)
    rel_err: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def median_ms(fn: Callable[[], object], rep_ms: int = 300) -> float:
    """Median time of `fn` over repeated runs (CUDA events), after warm-up."""
    return triton.testing.do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Ceilings


def measure_ceilings(copy_elements=2**29, matmul_n=8192) -> tuple[list[Row], dict]:
    """Copy bandwidth (bytes read + written) over 2 GiB, and a bf16 8192^3 matmul on random data."""
    src = torch.randn(copy_elements, device=DEVICE)  # 2 GiB fp32
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_bytes = 2 * src.numel() * src.element_size()
    a, b = randn(matmul_n, matmul_n), randn(matmul_n, matmul_n)
    mm_ms = median_ms(lambda: a @ b)
    mm_flops = 2 * matmul_n**3
    ceilings = {"copy_GBps": copy_bytes / copy_ms / 1e6, "matmul_TFLOPs": mm_flops / mm_ms / 1e9}
    rows = [
        Row("ceiling", "device-to-device copy", f"{copy_bytes / 2**31:.0f} GiB fp32", copy_ms, bytes=copy_bytes),
        Row("ceiling", "bf16 matmul (cuBLAS)", f"{matmul_n}^3", mm_ms, flops=mm_flops),
    ]
    return rows, ceilings


# ---------------------------------------------------------------------------------------------------------------------
# Training step of a ~400M hybrid against the same model with the SSM branch off


def median_train_step_ms(model, args) -> float:
    """Median wall time of a full step (forward, backward, fused AdamW) after two warm-up steps."""
    times = step_times_ms(training_step(model, args.train_batch, args.train_seq_len), args.train_steps)
    return sorted(times)[len(times) // 2]


def bench_train_step(args) -> list[Row]:
    """Each variant's step, built afresh (same seed) in each of `--train-rounds` rounds, the variants' order reversed
    every other round, so that drift during the run (the host's load, the clocks) falls on all of them alike; a row's
    time is the median of its rounds, its peak the largest."""
    from configuration import HybridConfig
    from modeling import HybridForCausalLM

    def config(**overrides):
        fields = dict(TRAIN_STEP_CONFIG, sliding_window=args.train_window, max_position_embeddings=args.train_seq_len)
        return HybridConfig(**fields, **overrides)

    variants = [
        ("SSM branch off (SWA only)", {"use_ssm_branch": False}),
        ("hybrid, Triton kernels", {}),
        ("hybrid mamba2 N=16, Triton SSD", {"ssm_type": "mamba2"}),
        ("hybrid mamba2 N=128, Triton SSD", {"ssm_type": "mamba2", "ssm_state_size": 128}),
    ]
    if args.train_reference:
        variants.append(("hybrid, PyTorch reference", {"use_ssm_kernels": False}))
    rounds = {name: [] for name, _ in variants}
    peaks, params = {}, {}
    for round_index in range(args.train_rounds):
        for name, overrides in variants if round_index % 2 == 0 else variants[::-1]:
            torch.manual_seed(0)
            torch.cuda.reset_peak_memory_stats()
            model = HybridForCausalLM(config(**overrides)).to(DEVICE, torch.bfloat16)
            model.set_attn_implementation(args.train_attn)
            rounds[name].append(median_train_step_ms(model, args))
            # weights, AdamW states, activations, workspaces
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            params[name] = sum(p.numel() for p in model.parameters())
            del model
            torch.cuda.empty_cache()
    rows = []
    tokens = args.train_batch * args.train_seq_len
    for name, _ in variants:
        ms = statistics.median(rounds[name])
        rows.append(
            Row(
                "train step",
                name,
                f"{params[name] / 1e6:.0f}M params, B={args.train_batch} T={args.train_seq_len} W={args.train_window}",
                ms,
                note=f"{tokens / ms * 1e3:,.0f} tok/s, peak {peaks[name]:.1f} GiB, rounds "
                + "/".join(f"{t:.1f}" for t in rounds[name]),
                extra={"tokens_per_s": tokens / ms * 1e3, "peak_gib": peaks[name], "rounds_ms": rounds[name]},
            )
        )
    base = rows[0].extra
    for row in rows[1:]:
        row.note += (
            f" = {row.extra['tokens_per_s'] / base['tokens_per_s']:.2f}x SWA-only's tok/s,"
            f" {row.extra['peak_gib'] / base['peak_gib']:.2f}x its peak"
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Training kernels: selective scan and causal conv1d, forward + backward


def scan_inputs(batch, seq_len, channels, state, requires_grad=False):
    """bf16 u, z, B, C and fp32 dt / A / D, the dtypes the HF model hands the scan."""
    u, z = randn(batch, seq_len, channels), randn(batch, seq_len, channels)
    dt = F.softplus(randn(batch, seq_len, channels, dtype=torch.float32) - 3)
    A = -torch.exp(randn(channels, state, dtype=torch.float32, scale=0.5))
    B, C = randn(batch, seq_len, state), randn(batch, seq_len, state)
    D = randn(channels, dtype=torch.float32)
    tensors = [u, dt, A, B, C, D, z]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors


def ssd_inputs(batch, seq_len, heads, head_dim, state, requires_grad=False):
    """bf16 x, B, C (one group) and fp32 dt / A / D, the dtypes the Mamba-2 branch hands its scan."""
    tensors = [
        randn(batch, seq_len, heads, head_dim), F.softplus(randn(batch, seq_len, heads, dtype=torch.float32) - 3),
        -torch.exp(randn(heads, dtype=torch.float32, scale=0.5)), randn(batch, seq_len, 1, state),
        randn(batch, seq_len, 1, state), randn(heads, dtype=torch.float32),
    ]  # fmt: skip
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors


def bench_scan(args) -> list[Row]:
    from modeling.ops import selective_scan_ref
    from modeling.ops.selective_scan.interface import selective_scan_fn

    batch, seq_len, channels, state = args.scan_batch, args.scan_seq_len, args.scan_channels, 16
    shape = f"B={batch} T={seq_len} E={channels} N={state}"
    inputs = scan_inputs(batch, seq_len, channels, state, requires_grad=True)
    dy = randn(batch, seq_len, channels)

    def fwd_bwd(scan):
        def run():
            y, _ = scan(*inputs)
            return torch.autograd.grad(y, inputs, dy)

        return run

    # Check: the kernel's y and every gradient against autograd through the reference (fp32 math), same inputs.
    y, _ = selective_scan_fn(*inputs)
    y_ref, _ = selective_scan_ref(*inputs)
    grads = fwd_bwd(selective_scan_fn)()
    grads_ref = fwd_bwd(selective_scan_ref)()
    errs = {"y": rel_err(y, y_ref)}
    errs |= {f"d{name}": rel_err(g, r) for name, g, r in zip(["u", "dt", "A", "B", "C", "D", "z"], grads, grads_ref)}
    worst = max(errs.values())

    bte, btn = batch * seq_len * channels, batch * seq_len * state
    fwd_bytes = bte * (2 + 4 + 2 + 2) + btn * 2 * 2  # u, dt, z in; y out; B, C in
    bwd_bytes = bte * (2 + 4 + 2 + 2 + 2 + 4 + 2) + btn * 2 * 4  # u, dt, z, dy in; du, ddt, dz out; B, C, dB, dC
    with torch.no_grad():
        fwd_ms = median_ms(lambda: selective_scan_fn(*inputs))
        ref_fwd_ms = median_ms(lambda: selective_scan_ref(*inputs), rep_ms=100)
    fb_ms = median_ms(fwd_bwd(selective_scan_fn))
    ref_fb_ms = median_ms(fwd_bwd(selective_scan_ref), rep_ms=100)

    # The model's call: dt_proj's raw bf16 output, the step's softplus taken inside the scan (fwd and bwd).
    raw_dt = randn(batch, seq_len, channels, scale=0.5) - 3
    model_inputs = [*inputs[:1], raw_dt.requires_grad_(True), *inputs[2:]]

    def model_fwd_bwd(scan):
        def run():
            y, _ = scan(*model_inputs, dt_softplus=True)
            return torch.autograd.grad(y, model_inputs, dy)

        return run

    model_errs = [
        rel_err(g, r) for g, r in zip(model_fwd_bwd(selective_scan_fn)(), model_fwd_bwd(selective_scan_ref)())
    ]
    model_fb_ms = median_ms(model_fwd_bwd(selective_scan_fn))
    return [
        Row("scan", "Triton fwd", shape, fwd_ms, bytes=fwd_bytes, rel_err=errs["y"],
            note=f"{ref_fwd_ms / fwd_ms:.0f}x reference"),
        Row("scan", "PyTorch reference fwd", shape, ref_fwd_ms, bytes=fwd_bytes),
        Row("scan", "Triton fwd+bwd", shape, fb_ms, bytes=fwd_bytes + bwd_bytes, rel_err=worst,
            note=f"{ref_fb_ms / fb_ms:.0f}x reference; floor x{fb_ms / ((fwd_bytes + bwd_bytes) / CEILINGS['copy_GBps'] / 1e6):.1f}",
            extra=errs),
        Row("scan", "PyTorch reference fwd+bwd", shape, ref_fb_ms, bytes=fwd_bytes + bwd_bytes),
        Row("scan", "Triton fwd+bwd, bf16 raw dt + softplus", shape, model_fb_ms, rel_err=max(model_errs),
            note="the model's call (dt_softplus=True)"),
    ]  # fmt: skip


def bench_ssd(args) -> list[Row]:
    """Mamba-2's chunked scan (modeling/ops/ssd) at the training shape, forward and backward, on its Triton kernels
    against its eager reference and against that reference compiled by Inductor (the branch's training path before the
    kernels), beside the Mamba-1 Triton scan over the same channels (N 16): what each branch's scan costs."""
    from modeling.ops import selective_scan_ref, ssd_chunk_scan_ref
    from modeling.ops.selective_scan.interface import selective_scan_fn
    from modeling.ops.ssd.forward import CHUNK
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    batch, seq_len, channels, head_dim = args.train_batch, args.train_seq_len, args.ssd_channels, 64
    heads, state, chunk = channels // head_dim, args.ssd_state, CHUNK
    shape = f"B={batch} T={seq_len} H={heads} P={head_dim} N={state} G=1 L={chunk}"
    inputs = ssd_inputs(batch, seq_len, heads, head_dim, state, requires_grad=True)
    dy = randn(batch, seq_len, heads, head_dim)

    def reference(*args):
        return ssd_chunk_scan_ref(*args, chunk)

    compiled_reference = torch.compile(reference, fullgraph=True)

    def fwd_bwd(scan):
        def run():
            y, _ = scan(*inputs)
            return torch.autograd.grad(y, inputs, dy)

        return run

    errs = {"y": rel_err(ssd_chunk_scan_fn(*inputs)[0], reference(*inputs)[0])}
    names = ["x", "dt", "A", "B", "C", "D"]
    errs |= {f"d{n}": rel_err(g, r) for n, g, r in zip(names, fwd_bwd(ssd_chunk_scan_fn)(), fwd_bwd(reference)())}
    # The fewest FLOPs: C B^T per group and chunk, its product with x per head, and the chunk states in and out.
    fwd_flops = 2 * batch * seq_len * (chunk * state + heads * chunk * head_dim + 2 * heads * head_dim * state)
    with torch.no_grad():
        fwd_ms = median_ms(lambda: ssd_chunk_scan_fn(*inputs))
    fb_ms = median_ms(fwd_bwd(ssd_chunk_scan_fn))
    compiled_fb_ms = median_ms(fwd_bwd(compiled_reference))
    ref_fb_ms = median_ms(fwd_bwd(reference), rep_ms=100)

    mamba1_inputs = scan_inputs(batch, seq_len, channels, 16, requires_grad=True)
    mamba1_dy = randn(batch, seq_len, channels)

    def mamba1_fwd_bwd():
        y, _ = selective_scan_fn(*mamba1_inputs)
        return torch.autograd.grad(y, mamba1_inputs, mamba1_dy)

    mamba1_err = rel_err(selective_scan_fn(*mamba1_inputs)[0], selective_scan_ref(*mamba1_inputs)[0])
    mamba1_ms = median_ms(mamba1_fwd_bwd)

    # The layer's other branch at the same tokens: the probe's causal attention (16 query heads over 4 KV heads of 64)
    # through SDPA, which picks cuDNN's fused attention on Hopper (FlashAttention 3 is not installed on the device).
    q = randn(batch, 16, seq_len, 64).requires_grad_()
    k, v = (randn(batch, 4, seq_len, 64).requires_grad_() for _ in range(2))
    attention_dy = randn(batch, 16, seq_len, 64)

    def attention_fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(out, (q, k, v), attention_dy)

    attention_ms = median_ms(attention_fwd_bwd)

    # One prompt's prefill through generate() (no grad): --ssd-prefill-len tokens, the same heads
    prefill_len = args.ssd_prefill_len
    prefill = ssd_inputs(1, prefill_len, heads, head_dim, state)
    prefill_shape = f"B=1 T={prefill_len} H={heads} P={head_dim} N={state} G=1 L={chunk}"
    mamba1_prefill = scan_inputs(1, prefill_len, channels, 16)
    with torch.no_grad():
        prefill_err = rel_err(ssd_chunk_scan_fn(*prefill)[0], reference(*prefill)[0])
        prefill_ms = median_ms(lambda: ssd_chunk_scan_fn(*prefill))
        mamba1_prefill_ms = median_ms(lambda: selective_scan_fn(*mamba1_prefill))
    return [
        Row("ssd", "Triton fwd", shape, fwd_ms, flops=fwd_flops, rel_err=errs["y"]),
        Row("ssd", "Triton fwd+bwd", shape, fb_ms, flops=3 * fwd_flops, rel_err=max(errs.values()),
            note=f"{compiled_fb_ms / fb_ms:.2f}x the compiled reference; {ref_fb_ms / fb_ms:.1f}x eager; "
            f"{mamba1_ms / fb_ms:.2f}x the Mamba-1 scan's speed", extra=errs),
        Row("ssd", "Inductor-compiled reference fwd+bwd", shape, compiled_fb_ms,
            flops=3 * fwd_flops),
        Row("ssd", "eager reference fwd+bwd", shape, ref_fb_ms, flops=3 * fwd_flops),
        Row("ssd", "Mamba-1 Triton scan fwd+bwd (anchor)", f"B={batch} T={seq_len} E={channels} N=16", mamba1_ms,
            rel_err=mamba1_err),
        Row("ssd", "causal attention fwd+bwd, SDPA (anchor)", f"B={batch} T={seq_len} 16/4 heads x 64", attention_ms,
            flops=3.5 * 2 * batch * 16 * seq_len * seq_len * 64,
            note=f"the SSD scan takes {fb_ms / attention_ms:.2f}x its time"),
        Row("ssd", "Triton fwd, one prompt's prefill (no grad)", prefill_shape, prefill_ms, rel_err=prefill_err,
            note=f"{mamba1_prefill_ms / prefill_ms:.2f}x the Mamba-1 scan's speed"),
        Row("ssd", "Mamba-1 Triton scan fwd, same prefill (anchor)", f"B=1 T={prefill_len} E={channels} N=16",
            mamba1_prefill_ms),
    ]  # fmt: skip


def conv_reference(x, weight, bias):
    """What the PyTorch path does: channel-major, left zero padding, grouped conv1d, silu."""
    K = weight.shape[-1]
    x_cm = F.pad(x.transpose(1, 2), (K - 1, 0))
    return F.silu(F.conv1d(x_cm, weight[:, None, :], bias, groups=x.shape[-1])).transpose(1, 2)


def bench_conv(args) -> list[Row]:
    from modeling.ops.causal_conv1d.interface import causal_conv1d_bwd, causal_conv1d_fn

    batch, seq_len, channels, K = args.scan_batch, args.scan_seq_len, args.scan_channels, 4
    shape = f"B={batch} T={seq_len} E={channels} K={K}, x strided"
    xz = randn(batch, seq_len, 2 * channels).requires_grad_(True)
    x = xz[..., :channels]  # the in_proj half, as the model hands it over: stride(1) = 2E
    weight = randn(channels, K, dtype=torch.bfloat16, scale=0.5).requires_grad_(True)
    bias = randn(channels, dtype=torch.bfloat16).requires_grad_(True)
    dy = randn(batch, seq_len, channels)

    def fwd_bwd(conv):
        def run():
            y = conv(x, weight, bias)
            return torch.autograd.grad(y, [x, weight, bias], dy)

        return run

    kernel = lambda x, w, b: causal_conv1d_fn(x, w, b, "silu")
    y, y_ref = kernel(x, weight, bias), conv_reference(x.float(), weight.float(), bias.float())
    grads, grads_ref = fwd_bwd(kernel)(), fwd_bwd(lambda x, w, b: conv_reference(x.float(), w.float(), b.float()))()
    errs = {"y": rel_err(y, y_ref)} | {f"d{n}": rel_err(g, r) for n, g, r in zip(["x", "w", "b"], grads, grads_ref)}
    bte = batch * seq_len * channels
    fwd_bytes, fb_bytes = 2 * bte * 2, 2 * bte * 2 + 3 * bte * 2  # fwd: x in, y out; bwd: x, dy in, dx out
    with torch.no_grad():
        fwd_ms = median_ms(lambda: kernel(x, weight, bias))
        ref_fwd_ms = median_ms(lambda: conv_reference(x, weight, bias))
    fb_ms, ref_fb_ms = median_ms(fwd_bwd(kernel)), median_ms(fwd_bwd(conv_reference))
    # The backward launcher alone: fwd+bwd through autograd against the launchers' own times (BENCHMARKS.md).
    bwd_ms = median_ms(lambda: causal_conv1d_bwd(x.detach(), weight.detach(), bias.detach(), dy, "silu"))
    return [
        Row("conv1d", "Triton fwd", shape, fwd_ms, bytes=fwd_bytes, rel_err=errs["y"],
            note=f"{ref_fwd_ms / fwd_ms:.1f}x PyTorch"),
        Row("conv1d", "PyTorch conv1d+silu fwd (bf16)", shape, ref_fwd_ms, bytes=fwd_bytes),
        Row("conv1d", "Triton fwd+bwd", shape, fb_ms, bytes=fb_bytes, rel_err=max(errs.values()),
            note=f"{ref_fb_ms / fb_ms:.1f}x PyTorch", extra=errs),
        Row("conv1d", "PyTorch conv1d+silu fwd+bwd (bf16)", shape, ref_fb_ms, bytes=fb_bytes),
        Row("conv1d", "Triton bwd launcher alone", shape, bwd_ms, bytes=3 * bte * 2),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Serving kernels: varlen prefill (conv + scan from state slots), paged window attention, fused decode


def vllm_ops():
    """vLLM's own kernels when vLLM (CUDA build) is importable, else None."""
    if DEVICE != "cuda":
        return None
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_scan_fn, selective_state_update
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as error:  # noqa: BLE001 - any import failure means: no vLLM anchors in this run
        print(f"vLLM anchors skipped: {type(error).__name__}: {error}")
        return None
    ops = {
        "causal_conv1d_fn": causal_conv1d_fn,
        "selective_scan_fn": selective_scan_fn,
        "selective_state_update": selective_state_update,
        "unified_attention": unified_attention,
    }
    try:  # the Mamba-2 prefill row's: without them that row alone is skipped
        from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata
        from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata
    except Exception as error:  # noqa: BLE001 - as above, for the Mamba-2 row only
        print(f"vLLM's Mamba-2 anchor skipped: {type(error).__name__}: {error}")
        return ops
    return {
        **ops,
        "mamba_chunk_scan_combined_varlen": mamba_chunk_scan_combined_varlen,
        "compute_varlen_chunk_metadata": compute_varlen_chunk_metadata,
        "compute_causal_conv1d_metadata": compute_causal_conv1d_metadata,
        "rms_norm_gated": rms_norm_gated,
    }


@dataclass
class PrefillBatch:
    """Packed prefills (--prefill-seqs of --prefill-seq-len tokens, --serve-channels channels, N 16, K 4) continuing
    from state slots, half of them with an initial state, in the dtypes serving hands the kernels."""

    shape: str
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    has_initial: torch.Tensor
    xs: torch.Tensor  # [T, E] views of one [T, 2E] in_proj output, as z
    z: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    conv_state0: torch.Tensor
    dt: torch.Tensor  # raw dt_proj output: dt_args apply its bias and softplus in the scan
    B: torch.Tensor
    C: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    dt_args: dict
    ssm_state0: torch.Tensor


def prefill_batch(args) -> PrefillBatch:
    num_seqs, seq_len, channels, state, K = args.prefill_seqs, args.prefill_seq_len, args.serve_channels, 16, 4
    total = num_seqs * seq_len
    num_slots = 2 * num_seqs + 1
    xs, z = randn(total, 2 * channels).chunk(2, dim=-1)
    dt_bias = randn(channels, dtype=torch.float32, scale=0.5) - 3
    return PrefillBatch(
        shape=f"{num_seqs} seqs x {seq_len}, E={channels} N={state}",
        cu_seqlens=torch.arange(0, total + 1, seq_len, device=DEVICE, dtype=torch.int32),
        slots=torch.randperm(num_slots - 1, device=DEVICE)[:num_seqs].to(torch.int32) + 1,
        has_initial=torch.arange(num_seqs, device=DEVICE) % 2 == 0,
        xs=xs,
        z=z,
        weight=randn(channels, K, scale=0.5),
        bias=randn(channels),
        conv_state0=randn(num_slots, channels, K - 1),
        dt=randn(total, channels, scale=0.5),
        B=randn(total, state),
        C=randn(total, state),
        A=-torch.exp(randn(channels, state, dtype=torch.float32, scale=0.5)),
        D=randn(channels, dtype=torch.float32),
        dt_args={"dt_bias": dt_bias, "dt_softplus": True},
        ssm_state0=randn(num_slots, channels, state, dtype=torch.float32),
    )


def bench_prefill(args) -> list[Row]:
    """Packed prefills continuing from state slots: conv varlen then scan varlen, as the vLLM backend runs them."""
    from modeling.ops import causal_conv1d_varlen_ref, selective_scan_varlen_ref
    from modeling.ops.causal_conv1d.interface import causal_conv1d_varlen_fwd
    from modeling.ops.selective_scan.interface import selective_scan_varlen_fwd

    b = prefill_batch(args)
    num_seqs, channels, state, K = args.prefill_seqs, args.serve_channels, b.B.shape[1], b.weight.shape[1]
    seqs = (b.cu_seqlens, b.slots, b.has_initial)

    def ours(conv_state, ssm_state, out):
        u = causal_conv1d_varlen_fwd(b.xs, b.weight, b.bias, conv_state, *seqs, "silu")
        selective_scan_varlen_fwd(u, b.dt, b.A, b.B, b.C, b.D, b.z, ssm_state, *seqs, out, **b.dt_args)
        return u

    def reference(conv_state, ssm_state, out):
        u = causal_conv1d_varlen_ref(b.xs, b.weight, b.bias, conv_state, *seqs, "silu")
        selective_scan_varlen_ref(u, b.dt, b.A, b.B, b.C, b.D, b.z, ssm_state, *seqs, out, **b.dt_args)
        return u

    results = []
    for fn in (ours, reference):
        conv_state, ssm_state, out = b.conv_state0.clone(), b.ssm_state0.clone(), torch.full_like(b.xs, float("nan"))
        u = fn(conv_state, ssm_state, out)
        results.append((u, out, conv_state, ssm_state))
    errs = {name: rel_err(x, y) for name, x, y in zip(["u", "y", "conv_state", "ssm_state"], results[0], results[1])}
    tokens_bytes = b.xs.shape[0] * channels * (2 + 2 + 2 + 2 + 2)  # xs, dt, z in; u out (and in again), y out
    state_bytes = 2 * num_seqs * channels * (state * 4 + (K - 1) * 2)
    work = [b.conv_state0.clone(), b.ssm_state0.clone(), torch.empty_like(b.xs)]
    rows = [
        Row("prefill", "Triton conv varlen + scan varlen", b.shape, median_ms(lambda: ours(*work)),
            bytes=tokens_bytes + state_bytes, rel_err=max(errs.values()), extra=errs),
        Row("prefill", "PyTorch references", b.shape, median_ms(lambda: reference(*work), rep_ms=100),
            bytes=tokens_bytes + state_bytes),
    ]  # fmt: skip
    if (vllm := vllm_ops()) is not None:
        # vLLM's Mamba-1 ops are channel-major ([E, T]): hand them that layout, made before timing.
        xs_cm, dt_cm, z_cm = b.xs.t().contiguous(), b.dt.t().contiguous(), b.z.t().contiguous()
        B_cm, C_cm = b.B.t().contiguous()[None], b.C.t().contiguous()[None]
        conv_state_v = b.conv_state0.clone()
        ssm_state_v = b.ssm_state0.clone()

        def vllm_prefill():
            u = vllm["causal_conv1d_fn"](
                xs_cm, b.weight, b.bias, conv_states=conv_state_v, query_start_loc=b.cu_seqlens,
                cache_indices=b.slots, has_initial_state=b.has_initial, activation="silu",
            )  # fmt: skip
            return vllm["selective_scan_fn"](
                u, ssm_state_v, dt_cm, b.A, B_cm, C_cm, b.D, z_cm, b.dt_args["dt_bias"], True, *seqs
            )

        rows.append(Row("prefill", "vLLM causal_conv1d_fn + selective_scan_fn", b.shape + " (E-major)",
                        median_ms(vllm_prefill), bytes=tokens_bytes + state_bytes))  # fmt: skip
    mamba2_vllm = vllm if vllm and "mamba_chunk_scan_combined_varlen" in vllm else None
    rows += mamba2_prefill_rows(b, mamba2_vllm)
    base = rows[0].ms
    for row in rows[1:]:
        row.note = f"ours is {row.ms / base:.1f}x faster"
        if row.variant.startswith("Mamba-2"):
            row.note = f"{row.ms / base:.2f}x the time of our Mamba-1 prefill (first row)"
    return rows


def mamba2_prefill_rows(b: PrefillBatch, vllm: dict | None, head_dim=64, state=128, chunk=256) -> list[Row]:
    """The same packed prefills through a Mamba-2 branch of the same width as `hybrid-mamba2` serves it (E / 64 heads
    of 64 channels, one group, N 128, chunks of 256), between its projections: the conv over the E + 2N conv channels
    (channel-last rows of a wider in_proj output), the scan on views of the conv's output (x, B, C) and of the in_proj
    output (dt), from the slots' states (zeros for fresh prefills) into them, and the gated norm of the scan's output
    by z (a column view of in_proj's output). On our kernels (`causal_conv1d_varlen_fwd`, `ssd_varlen_scan_fwd` in
    tiles of 64, `gated_rms_norm_fwd`), and where vLLM is importable on vLLM's (`causal_conv1d_fn` on a [C, T] view,
    its program tables built beforehand; `mamba_chunk_scan_combined_varlen`, its chunks built beforehand as its
    metadata builder does; `rms_norm_gated`) and our conv with vLLM's scan and norm; then each op alone. Every op
    checked against its reference (`causal_conv1d_varlen_ref`, `ssd_varlen_scan_ref`, `gated_rms_norm_ref`)."""
    from modeling.ops import causal_conv1d_varlen_ref, gated_rms_norm_ref, ssd_varlen_scan_ref
    from modeling.ops.causal_conv1d.interface import causal_conv1d_varlen_fwd
    from modeling.ops.ssd.gated_norm import gated_rms_norm_fwd
    from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

    total, channels = b.xs.shape
    heads, conv_channels = channels // head_dim, channels + 2 * state
    num_seqs, num_slots = b.slots.shape[0], b.conv_state0.shape[0]
    seqs = (b.cu_seqlens, b.slots, b.has_initial)
    # in_proj's output: z | xBC | dt
    in_proj_out = randn(total, channels + conv_channels + heads, scale=0.5)
    z, xbc, dt = in_proj_out[:, :channels], in_proj_out[:, channels:-heads], in_proj_out[:, -heads:]
    weight = randn(conv_channels, 4, scale=0.5)
    conv_state0 = randn(num_slots, 3, conv_channels).transpose(1, 2)  # vLLM's layout: [slots, C, K-1] view
    A = -torch.exp(randn(heads, dtype=torch.float32, scale=0.5))
    D, dt_bias = randn(heads, dtype=torch.float32), randn(heads, dtype=torch.float32, scale=0.5) - 3
    ssm_state0 = randn(num_slots, heads, head_dim, state, dtype=torch.float32)
    norm_weight = randn(channels, scale=0.5) + 1

    def heads_and_groups(conv_out):
        x, B, C = conv_out.split([channels, state, state], dim=-1)
        return x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (1, state)), C.unflatten(-1, (1, state))

    convs, scans, norms = {}, {}, {}
    convs["ours"] = lambda conv_state, out: causal_conv1d_varlen_fwd(
        xbc, weight, None, conv_state, *seqs, "silu", out
    )  # fmt: skip

    def our_scan(conv_out, ssm_state, out):
        x, B, C = heads_and_groups(conv_out)
        return ssd_varlen_scan_fwd(x, dt, A, B, C, D, ssm_state, *seqs, chunk, out, dt_bias=dt_bias, dt_softplus=True)

    scans["ours"] = our_scan
    norms["ours"] = lambda y: gated_rms_norm_fwd(y, z, norm_weight, channels, 1e-5)
    if vllm:
        chunks = vllm["compute_varlen_chunk_metadata"](b.cu_seqlens, chunk)
        nums_dict, batch_ptr, token_chunk_offset_ptr = vllm["compute_causal_conv1d_metadata"](
            b.cu_seqlens.cpu(), device=b.cu_seqlens.device
        )
        conv_tables = SimpleNamespace(
            nums_dict=nums_dict, batch_ptr=batch_ptr, token_chunk_offset_ptr=token_chunk_offset_ptr
        )

        def vllm_conv(conv_state, out):
            y = vllm["causal_conv1d_fn"](
                xbc.T, weight, None, conv_states=conv_state, query_start_loc=b.cu_seqlens, cache_indices=b.slots,
                has_initial_state=b.has_initial, activation="silu", metadata=conv_tables,
            )  # fmt: skip
            return out.copy_(y.T)

        def vllm_scan(conv_out, ssm_state, out):
            x, B, C = heads_and_groups(conv_out)
            initial = torch.where(b.has_initial[:, None, None, None], ssm_state[b.slots], 0)
            final = vllm["mamba_chunk_scan_combined_varlen"](
                x, dt, A, B, C, chunk, b.cu_seqlens, *chunks, out, D=D, dt_bias=dt_bias, initial_states=initial,
                dt_softplus=True, state_dtype=ssm_state.dtype,
            )  # fmt: skip
            ssm_state[b.slots] = final
            return out

        convs["vllm"], scans["vllm"] = vllm_conv, vllm_scan
        norms["vllm"] = lambda y: vllm["rms_norm_gated"](
            y, norm_weight, None, z=z, eps=1e-5, group_size=channels, norm_before_gate=False
        )  # fmt: skip

    # Each op against its reference, on the reference's inputs.
    conv_want_state = conv_state0.clone()
    conv_want = causal_conv1d_varlen_ref(xbc, weight, None, conv_want_state, *seqs, "silu")
    x, B, C = heads_and_groups(conv_want)
    scan_want_state = ssm_state0.clone()
    scan_want = ssd_varlen_scan_ref(x.float(), dt, A, B.float(), C.float(), D, scan_want_state, *seqs, chunk,
                                    dt_bias=dt_bias, dt_softplus=True)  # fmt: skip
    y = scan_want.to(x.dtype).flatten(1)
    norm_want = gated_rms_norm_ref(y.float(), z.float(), norm_weight, channels, 1e-5)
    errs = {}
    for name in convs:
        conv_state, ssm_state = conv_state0.clone(), ssm_state0.clone()
        conv_out = convs[name](conv_state, torch.full_like(xbc, float("nan")))
        scan_out = scans[name](conv_want, ssm_state, torch.full_like(x, float("nan")))
        errs[name] = {
            "conv": rel_err(conv_out, conv_want), "conv_state": rel_err(conv_state, conv_want_state),
            "y": rel_err(scan_out, scan_want), "ssm_state": rel_err(ssm_state, scan_want_state),
            "norm": rel_err(norms[name](y), norm_want),
        }  # fmt: skip

    conv_state_bytes = 2 * num_seqs * conv_channels * 3 * 2
    conv_bytes = total * 2 * conv_channels * 2 + conv_state_bytes  # xBC in, out
    scan_bytes = total * (heads * 2 + 2 * channels * 2 + 2 * state * 2) + 2 * num_seqs * heads * head_dim * state * 4
    norm_bytes = total * channels * 2 * 3  # y, z in; out
    work_conv, work_xbc = conv_state0.clone(), conv_want.clone()
    work_state, work_y = ssm_state0.clone(), torch.empty_like(x)
    shape = f"{b.shape.split(', ')[0]}, E={channels} H={heads} P={head_dim} N={state}"
    conv_shape = f"{b.shape.split(', ')[0]}, C={conv_channels} K=4"

    def branch(conv, scan, norm):
        return norm(scan(conv(work_conv, work_xbc), work_state, work_y).flatten(1))

    def row(variant, fn, bytes, row_shape=shape, extra=None):
        return Row("prefill", variant, row_shape, median_ms(fn), bytes=bytes,
                   rel_err=max(extra.values()) if extra else None, extra=extra or {})  # fmt: skip

    names = {"ours": "ours", "vllm": "vLLM's"}
    rows = [
        row(f"Mamba-2 (N 128): conv, scan and gated norm, {names[name]}",
            functools.partial(branch, convs[name], scans[name], norms[name]),
            conv_bytes + scan_bytes + norm_bytes, extra=errs[name])
        for name in convs
    ]  # fmt: skip
    if vllm:
        rows.append(row("Mamba-2 (N 128): our conv, vLLM's scan and gated norm",
                        functools.partial(branch, convs["ours"], scans["vllm"], norms["vllm"]),
                        conv_bytes + scan_bytes + norm_bytes))  # fmt: skip
    for name in convs:
        rows += [
            row(f"Mamba-2 conv alone, {names[name]}", lambda conv=convs[name]: conv(work_conv, work_xbc), conv_bytes,
                conv_shape),
            row(f"Mamba-2 scan alone, {names[name]}", lambda scan=scans[name]: scan(work_xbc, work_state, work_y),
                scan_bytes),
            row(f"Mamba-2 gated norm alone (one group), {names[name]}",
                lambda norm=norms[name]: norm(work_y.flatten(1)), norm_bytes),
        ]  # fmt: skip
    return rows


def paged_kv(seq_lens, num_kv_heads, head_dim, block_size):
    """bf16 key and value caches [num_blocks, block_size, KVH, D], views of vLLM's Triton layout, with random contents
    everywhere (no slot poisoned, no block freed), and a block table [S, MB] that scatters each sequence over random
    blocks (`paged_kv_cache`, the kernel tests' builder)."""
    from tools.paged_cache import paged_kv_cache

    return paged_kv_cache(seq_lens, None, block_size, num_kv_heads, head_dim, torch.bfloat16, "triton",
                          torch.Generator(device=DEVICE).manual_seed(0), device=DEVICE, poison=False)  # fmt: skip


def gather_kv(cache, block_table, seq_len, row):
    """[seq_len, KVH, D] of one sequence, through its block table."""
    return cache[block_table[row].long()].flatten(0, 1)[:seq_len]


def attention_flops(positions: torch.Tensor, window, num_heads, head_dim) -> float:
    keys = positions + 1 if window is None else torch.clamp(positions + 1, max=window)
    return float(keys.double().sum().item()) * num_heads * head_dim * 4


def bench_attention(args) -> list[Row]:
    """Full prefills of long sequences through the paged window attention, against flex_attention with a
    sliding-window block mask and SDPA with a windowed mask (dense [T, T] mask), on the same Q/K/V, and vLLM's
    FlashAttention 3 on the same paged cache where it runs (Hopper, vLLM on the path)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from vllm_integration.ops.paged_attention.flash import flash_attention_available, flash_paged_window_attention
    from vllm_integration.ops.paged_attention.interface import paged_window_attention

    num_seqs, seq_len, window = args.attn_seqs, args.attn_seq_len, args.window
    H, KVH, D, block_size = args.heads, args.kv_heads, args.head_dim, args.block_size
    shape = f"{num_seqs} x {seq_len} tok, W={window}, {H}x{D} q, {KVH} kv"
    total = num_seqs * seq_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=DEVICE)
    key_cache, value_cache, block_table = paged_kv([seq_len] * num_seqs, KVH, D, block_size)
    query = randn(total, H, D)
    scale = D**-0.5
    out = torch.full_like(query, float("nan"))

    def ours():
        return paged_window_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
                                      window, out=out, max_query_len=seq_len, max_seq_len=seq_len)  # fmt: skip

    # Dense [S, H, T, D] copies of the same keys for the anchors.
    q_d = query.view(num_seqs, seq_len, H, D).transpose(1, 2)
    k_d = torch.stack([gather_kv(key_cache, block_table, seq_len, i) for i in range(num_seqs)]).transpose(1, 2)
    v_d = torch.stack([gather_kv(value_cache, block_table, seq_len, i) for i in range(num_seqs)]).transpose(1, 2)

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    block_mask = create_block_mask(in_window, None, None, seq_len, seq_len, device=DEVICE)
    flex = torch.compile(flex_attention)
    positions = torch.arange(seq_len, device=DEVICE)
    dense_mask = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < window)

    ours()
    reference = F.scaled_dot_product_attention(q_d.float(), k_d.float(), v_d.float(), attn_mask=dense_mask,
                                               scale=scale, enable_gqa=True)  # fmt: skip
    reference = reference.transpose(1, 2).reshape(total, H, D)
    flops = num_seqs * attention_flops(positions, window, H, D)
    flex_out = flex(q_d, k_d, v_d, block_mask=block_mask, scale=scale, enable_gqa=True)
    sdpa = lambda: F.scaled_dot_product_attention(q_d, k_d, v_d, attn_mask=dense_mask, scale=scale, enable_gqa=True)
    rows = [
        Row("attn prefill", "Triton paged window attention", shape, median_ms(ours), flops=flops,
            rel_err=rel_err(out, reference)),
        Row("attn prefill", "flex_attention (sliding block mask)", shape,
            median_ms(lambda: flex(q_d, k_d, v_d, block_mask=block_mask, scale=scale, enable_gqa=True)), flops=flops,
            rel_err=rel_err(flex_out.transpose(1, 2).reshape(total, H, D), reference)),
        Row("attn prefill", "SDPA, windowed mask", shape, median_ms(sdpa), flops=flops,
            rel_err=rel_err(sdpa().transpose(1, 2).reshape(total, H, D), reference)),
    ]  # fmt: skip
    if flash_attention_available(query.dtype, D):  # what the serving prefills run on Hopper (vLLM's FA3)
        flash_out = torch.full_like(query, float("nan"))

        def flash():
            return flash_paged_window_attention(
                query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window, flash_out,
                max_query_len=seq_len, max_seq_len=seq_len,
            )  # fmt: skip

        flash()
        rows.append(Row("attn prefill", "vLLM FlashAttention 3 (paged, same cache)", shape, median_ms(flash),
                        flops=flops, rel_err=rel_err(flash_out, reference)))  # fmt: skip
    for row in rows[1:]:
        row.note = f"ours is {row.ms / rows[0].ms:.2f}x faster"
    return rows


def bench_decode(args) -> list[Row]:
    """One decode step of a batch: window attention over the paged KV and the SSM state update. The fused kernel
    (one launch) against the same work in separate launches of vLLM's unified_attention and selective_state_update,
    where vLLM is importable."""
    from vllm_integration.ops import hybrid_decode_ref
    from vllm_integration.ops.hybrid_decode.interface import hybrid_decode

    batch, window, context = args.decode_batch, args.window, args.decode_context
    H, KVH, D, block_size = args.heads, args.kv_heads, args.head_dim, args.block_size
    E, N = args.serve_channels, 16
    shape = f"batch {batch}, ctx~{context}, W={window}, {H}x{D} q, {KVH} kv, E={E}"
    gen = torch.Generator(device="cpu").manual_seed(0)
    seq_lens = torch.randint(context // 2, context + 1, (batch,), generator=gen).to(DEVICE, torch.int32)
    key_cache, value_cache, block_table = paged_kv(seq_lens.tolist(), KVH, D, block_size)
    query = randn(batch, H, D)
    scale = D**-0.5
    num_slots = 2 * batch + 1
    state_indices = (torch.randperm(num_slots - 1, device=DEVICE)[:batch] + 1).to(torch.int32)
    ssm_state = randn(num_slots, E, N, dtype=torch.float32)
    u, dt, z = randn(batch, E), randn(batch, E, scale=0.5), randn(batch, E)
    B, C = randn(batch, N), randn(batch, N)
    A = -torch.exp(randn(E, N, dtype=torch.float32, scale=0.5))
    D_skip, dt_bias = randn(E, dtype=torch.float32), randn(E, dtype=torch.float32, scale=0.5) - 3
    attn_out, ssm_out = torch.full_like(query, float("nan")), torch.full_like(u, float("nan"))
    ssm_args = (A, B, C, D_skip, z, dt_bias)

    def fused(state):
        hybrid_decode(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out,
                      state, u, dt, *ssm_args, state_indices, ssm_out)  # fmt: skip

    state = ssm_state.clone()
    fused(state)
    ref_attn, ref_ssm = torch.empty_like(attn_out), torch.empty_like(ssm_out)
    ref_state = ssm_state.clone()
    hybrid_decode_ref(query, key_cache, value_cache, block_table, seq_lens, scale, window, ref_attn,
                      ref_state, u, dt, *ssm_args, state_indices, ref_ssm)  # fmt: skip
    errs = {"attn": rel_err(attn_out, ref_attn), "ssm": rel_err(ssm_out, ref_ssm), "state": rel_err(state, ref_state)}

    kv_tokens = torch.clamp(seq_lens, max=window).double().sum().item()
    kv_bytes = kv_tokens * KVH * D * 2 * key_cache.element_size()
    state_bytes = batch * E * N * 4 * 2 + batch * E * 2 * 4  # state in + out; u, dt, z in, y out
    total = kv_bytes + state_bytes + 2 * query.numel() * 2
    work = ssm_state.clone()  # the timed runs keep stepping one state: the values stay bounded (decay < 1)
    rows = [
        Row("decode", "Triton fused (1 launch)", shape, median_ms(lambda: fused(work)), bytes=total,
            rel_err=max(errs.values()), extra=errs),
    ]  # fmt: skip
    if (vllm := vllm_ops()) is not None:
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)  # one query each
        seg = 16
        segm_out = torch.empty(seg, H, 16, triton.next_power_of_2(D), dtype=torch.float32, device=DEVICE)
        segm_max = torch.empty(seg, H, 16, dtype=torch.float32, device=DEVICE)
        segm_sum = torch.empty_like(segm_max)

        def vllm_separate():
            vllm["unified_attention"](
                q=query, k=key_cache, v=value_cache, out=attn_out, cu_seqlens_q=query_start_loc, max_seqlen_q=1,
                seqused_k=seq_lens, max_seqlen_k=context, softmax_scale=scale, causal=True,
                window_size=(window - 1, 0), block_table=block_table, softcap=0, q_descale=None, k_descale=None,
                v_descale=None, seq_threshold_3D=128 // KVH, num_par_softmax_segments=16,
                softmax_segm_output=segm_out, softmax_segm_max=segm_max, softmax_segm_expsum=segm_sum,
            )  # fmt: skip
            vllm["selective_state_update"](
                work, u, dt, A, B, C, D_skip, dt_bias, z=z, dt_softplus=True, state_batch_indices=state_indices,
                out=ssm_out,
            )  # fmt: skip

        vllm_separate()
        rows.append(Row("decode", "vLLM unified_attention + selective_state_update", shape,
                        median_ms(vllm_separate), bytes=total, rel_err=rel_err(attn_out, ref_attn)))  # fmt: skip
    for row in rows[1:]:
        row.note = f"fused is {row.ms / rows[0].ms:.2f}x faster"
    return rows + decode_mamba2_rows(args, shape, query, key_cache, value_cache, block_table, seq_lens, kv_bytes)


def decode_mamba2_rows(args, shape, query, key_cache, value_cache, block_table, seq_lens, kv_bytes) -> list[Row]:
    """The same decode step with a Mamba-2 branch of the same width (E / 64 heads of 64 channels, one group, N 128;
    fewer channels a head at smoke sizes):
    the fused kernel (`hybrid_decode_ssd`, one launch) against the attention and the state update in two launches
    (our paged window attention, then our `ssd_state_update`) and, where vLLM is importable, against the paged
    attention and vLLM's `selective_state_update` with heads. Every request continues its slot (has_initial_state
    all True)."""
    from modeling.ops.ssd.decode import ssd_state_update
    from vllm_integration.ops import hybrid_decode_ssd_ref
    from vllm_integration.ops.hybrid_decode.interface import hybrid_decode_ssd
    from vllm_integration.ops.paged_attention.interface import paged_window_attention

    batch, window, scale = query.shape[0], args.window, query.shape[-1] ** -0.5
    head_dim, state = min(64, args.serve_channels), 128
    heads = args.serve_channels // head_dim
    num_slots = 2 * batch + 1
    slots = (torch.randperm(num_slots - 1, device=DEVICE)[:batch] + 1).to(torch.int32)
    continues = torch.ones(batch, dtype=torch.bool, device=DEVICE)
    ssm_state = randn(num_slots, heads, head_dim, state, dtype=torch.float32, scale=0.1)
    x, dt = randn(batch, heads, head_dim), randn(batch, heads, scale=0.5)
    B, C = randn(batch, 1, state), randn(batch, 1, state)
    A, D_skip = -torch.exp(randn(heads, dtype=torch.float32, scale=0.5)), randn(heads, dtype=torch.float32)
    update = {"dt_bias": randn(heads, dtype=torch.float32, scale=0.5) - 3, "dt_softplus": True}
    attn_out, out = torch.full_like(query, float("nan")), torch.full_like(x, float("nan"))
    attention = (query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out)
    ssm = (A, B, C, D_skip, slots, continues)

    def fused(state_cache):
        hybrid_decode_ssd(*attention, state_cache, x, dt, *ssm, **update, out=out)

    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)  # one query each

    def attention_alone():
        paged_window_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window,
                               out=attn_out)  # fmt: skip

    def two_launches(state_cache):
        attention_alone()
        ssd_state_update(state_cache, x, dt, *ssm, **update, out=out)

    state_cache = ssm_state.clone()
    fused(state_cache)
    ref_attn, ref_out, ref_state = torch.empty_like(attn_out), torch.empty_like(out), ssm_state.clone()
    hybrid_decode_ssd_ref(*attention[:-1], ref_attn, ref_state, x, dt, *ssm, **update, out=ref_out)
    errs = {
        "attn": rel_err(attn_out, ref_attn),
        "ssm": rel_err(out, ref_out),
        "state": rel_err(state_cache, ref_state),
    }
    total = kv_bytes + batch * heads * head_dim * state * 4 * 2 + 2 * query.numel() * 2
    ssm_shape = f"{shape.split(', E=')[0]}, Mamba-2 {heads}x{head_dim} N={state}"
    work = ssm_state.clone()
    rows = [
        Row("decode", "Mamba-2: Triton fused (1 launch)", ssm_shape, median_ms(lambda: fused(work)), bytes=total,
            rel_err=max(errs.values()), extra=errs),
        Row("decode", "Mamba-2: paged attention + ssd_state_update (2 launches)", ssm_shape,
            median_ms(lambda: two_launches(work)), bytes=total),
    ]  # fmt: skip
    if (vllm := vllm_ops()) is not None:
        dt_heads = dt[..., None].expand(-1, -1, head_dim)
        A_heads = A[:, None, None].expand(-1, head_dim, state)
        D_heads, bias_heads = D_skip[:, None].expand(-1, head_dim), update["dt_bias"][:, None].expand(-1, head_dim)

        def with_vllm_update():
            attention_alone()
            vllm["selective_state_update"](
                work, x, dt_heads, A_heads, B, C, D_heads, bias_heads, dt_softplus=True, state_batch_indices=slots,
                out=out,
            )  # fmt: skip

        rows.append(Row("decode", "Mamba-2: paged attention + vLLM selective_state_update (2 launches)", ssm_shape,
                        median_ms(with_vllm_update), bytes=total))  # fmt: skip
    for row in rows[1:]:
        row.note = f"fused is {row.ms / rows[0].ms:.2f}x faster"
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Launch-configuration sweeps: one knob at a time around each kernel's default, at the benchmark shapes


def sweep(section: str, shape: str, run: Callable[..., object], variants: list[dict]) -> list[Row]:
    """Times `run()` (the defaults), then `run(**knobs)` for each variant's knobs."""
    rows = [Row(section, "default", shape, median_ms(run, rep_ms=100))]
    for knobs in variants:
        label = ", ".join(f"{knob}={value}" for knob, value in knobs.items())
        try:
            ms = median_ms(lambda: run(**knobs), rep_ms=100)  # noqa: B023 - timed before the loop moves on
        except Exception as error:  # noqa: BLE001 - a config that does not compile or fit is a result too
            rows.append(Row(section, label, shape, math.nan, note=f"{type(error).__name__}"))
            continue
        rows.append(Row(section, label, shape, ms, note=f"{rows[0].ms / ms:.2f}x default"))
    return rows


def kernel_breakdown(section: str, shape: str, run: Callable[[], object], repeats: int = 20) -> list[Row]:
    """One row per GPU kernel that `run()` launches, in launch order: its median time over `repeats` calls under
    torch.profiler (a launcher's stages, which CUDA events around the whole call cannot separate)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":  # smoke runs: nothing to profile
        return []
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    per_call = len(kernels) // repeats
    rows = []
    for i in range(per_call):
        times = sorted(e.time_range.elapsed_us() for e in kernels[i::per_call])
        rows.append(Row(section, f"kernel {i + 1} of {per_call}: {kernels[i].name[:24]}", shape,
                        times[len(times) // 2] / 1e3))  # fmt: skip
    return rows


def one_knob_at_a_time(grid: dict[str, list]) -> list[dict]:
    """Each value of each knob alone, the other knobs at their defaults."""
    return [{knob: value} for knob, values in grid.items() for value in values]


SCAN_COMBOS = [  # launch settings of the training scan that interact, timed fwd+bwd as whole combinations
    {"bwd_num_warps": 1},
    {"bwd_block_e": 32, "bwd_num_warps": 1},
    {"bwd_block_e": 32, "bwd_num_warps": 2},
    {"bwd_block_e": 64, "bwd_num_warps": 2},
    {"block_e": 32, "num_warps": 1, "bwd_num_warps": 1},
    {"block_e": 32, "num_warps": 1, "bwd_block_e": 32, "bwd_num_warps": 1},
    {"block_e": 32, "num_warps": 1, "bwd_block_e": 32, "bwd_num_warps": 1, "chunk": 256},
    {"save_seg_states": False},
    {"bwd_block_e": 32, "bwd_num_warps": 1, "seg": 8},
    {"bwd_block_e": 32, "bwd_num_warps": 1, "seg": 32},
]


def bench_step(args) -> list[Row]:
    """generate()'s decode step of the Mamba-1 branch between its projections (`Mamba1Branch._decode_step`, bf16
    weights, fp32 state, the shapes of bench_generate.py's small model by default): with plain modules the fused op
    (`mamba_inner_step`, two launches), against the same branch on its module path (a no-op hook on x_proj), the path
    an adapter or a hook on conv1d, x_proj or dt_proj takes (the conv update's kernel, the x_proj and dt_proj GEMMs,
    the state update's kernel). A decode batch moves little: these rows time launch latency and dependent memory
    trips."""
    from configuration import HybridConfig
    from modeling.history.mamba1 import KERNEL_OPS, Mamba1Branch
    from modeling.ops import mamba_inner_step_ref

    batch, E, R = args.step_batch, args.step_channels, args.step_dt_rank
    # the attention's sizes shape only in_proj and out_proj, which the step leaves out
    config = HybridConfig(
        hidden_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64, ssm_intermediate_size=E,
        ssm_dt_rank=R,
    )  # fmt: skip
    torch.manual_seed(0)
    branch = Mamba1Branch(config, layer_idx=0)
    branch.init_weights()
    with torch.no_grad():  # a trained conv's bias, not init's zeros
        branch.conv1d.bias.normal_(std=0.1)
    branch.to(DEVICE, torch.bfloat16)
    N, K = config.ssm_state_size, config.ssm_conv_kernel_size
    shape = f"B={batch} E={E} R={R} N={N} K={K}"
    xz = randn(batch, 1, 2 * E)
    conv_state, ssm_state = randn(batch, E, K - 1), randn(batch, E, N, dtype=torch.float32)

    def step(conv, ssm):
        return branch._decode_step(xz, SimpleNamespace(conv_states=[conv], recurrent_states=[ssm]), None, KERNEL_OPS)

    def on_module_path(fn):
        """`fn()` with a no-op hook on x_proj, which sends the branch down its module path as an adapter would."""
        hook = branch.x_proj.register_forward_hook(lambda *args: None)
        try:
            return fn()
        finally:
            hook.remove()

    weights = (branch.conv1d.weight, branch.conv1d.bias, branch.x_proj.weight, branch.dt_proj.weight,
               branch.dt_proj.bias, branch.A_log, branch.D)  # fmt: skip
    ref_conv, ref_ssm = conv_state.double(), ssm_state.double()
    ref = mamba_inner_step_ref(xz.double(), *(w.double() for w in weights), ref_conv, ref_ssm)
    errs = {}
    for name, run in (("fused", lambda fn: fn()), ("module path", on_module_path)):
        got_conv, got_ssm = conv_state.clone(), ssm_state.clone()
        got = run(lambda: step(got_conv, got_ssm))
        errs[name] = max(rel_err(got, ref), rel_err(got_conv, ref_conv), rel_err(got_ssm, ref_ssm))
    # the weights, the caches read and written, xz in and y out
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    cache_bytes = 2 * (conv_state.numel() * conv_state.element_size() + ssm_state.numel() * 4)
    total = weight_bytes + cache_bytes + xz.numel() * 2 + batch * E * 2
    fused_ms = median_ms(lambda: step(conv_state, ssm_state))
    module_ms = on_module_path(lambda: median_ms(lambda: step(conv_state, ssm_state)))
    return [
        Row("step", "Triton mamba_inner_step (2 launches)", shape, fused_ms, bytes=total, rel_err=errs["fused"],
            note=f"{module_ms / fused_ms:.2f}x the module path"),
        Row("step", "module path (2 kernels, 2 GEMMs, ~13 ops)", shape, module_ms, bytes=total,
            rel_err=errs["module path"]),
    ]  # fmt: skip


def bench_scan_sweep(args) -> list[Row]:
    """The training scan's launch settings, fwd+bwd (one knob at a time, then combinations of knobs that interact),
    and the forward alone at two channel blocks."""
    from modeling.ops.selective_scan.interface import selective_scan_fn

    batch, seq_len, channels = args.scan_batch, args.scan_seq_len, args.scan_channels
    shape = f"B={batch} T={seq_len} E={channels} N=16"
    inputs = scan_inputs(batch, seq_len, channels, 16, requires_grad=True)
    dy = randn(batch, seq_len, channels)

    def fwd_bwd(**knobs):
        y, _ = selective_scan_fn(*inputs, **knobs)
        return torch.autograd.grad(y, inputs, dy)

    def fwd(**knobs):
        with torch.no_grad():
            return selective_scan_fn(*inputs, **knobs)

    one_knob = one_knob_at_a_time({
        "chunk": [32, 64, 256, 512], "block_e": [8, 32], "num_warps": [1, 4], "bwd_num_warps": [2, 8],
        "unroll": [2], "seg": [8, 32],
    })  # fmt: skip
    fwd_variants = [{"block_e": 32, "num_warps": 1}, {"block_e": 16, "num_warps": 2}]
    return sweep("scan f+b", shape, fwd_bwd, one_knob + SCAN_COMBOS) + sweep("scan fwd", shape, fwd, fwd_variants)


def bench_ssd_sweep(args) -> list[Row]:
    """Mamba-2's scan kernels' launch shapes (`SSDBlocks`) at the training shape of `--only ssd`, one knob at a time:
    the walk's and the outputs kernel's on the forward alone, the backward's on forward and backward."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    batch, seq_len, heads, head_dim, state = (
        args.train_batch,
        args.train_seq_len,
        args.ssd_channels // 64,
        64,
        args.ssd_state,
    )
    shape = f"B={batch} T={seq_len} H={heads} P={head_dim} N={state} G=1"
    inputs = ssd_inputs(batch, seq_len, heads, head_dim, state, requires_grad=True)
    dy = randn(batch, seq_len, heads, head_dim)

    def fwd(**knobs):
        with torch.no_grad():
            return ssd_chunk_scan_fn(*inputs, **knobs)

    def fwd_bwd(**knobs):
        y, _ = ssd_chunk_scan_fn(*inputs, **knobs)
        return torch.autograd.grad(y, inputs, dy)

    bwd_knobs = one_knob_at_a_time({"bwd_n": [16, 64], "bwd_warps": [4]})
    return sweep("ssd fwd", shape, fwd, SSD_FWD_KNOBS) + sweep("ssd f+b", shape, fwd_bwd, bwd_knobs)


# The SSD forward's launch shapes around `pick_ssd_blocks`' defaults (walk tiles 32 x 64, outputs 64 x 64, 4 warps).
SSD_FWD_KNOBS = one_knob_at_a_time({
    "walk_p": [16, 64], "walk_n": [32, 128], "walk_warps": [2, 8], "out_p": [32], "out_n": [32, 128], "out_warps": [8],
})  # fmt: skip


def bench_ssd_varlen_sweep(args) -> list[Row]:
    """The serving SSD scan (`ssd_varlen_scan_fwd`) alone at the prefill shape (`--prefill-*`; E = --serve-channels
    in heads of 64, one group, N 128: `hybrid-mamba2`'s), x, B and C views of one conv output as served: its launch
    shapes one knob at a time and the kernels' chunk length (`tile`), then where the default's time goes (the walk,
    the outputs), beside the training forward on the same tokens."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn, ssd_varlen_scan_fwd

    b = prefill_batch(args)
    head_dim, state = 64, 128
    total, channels = b.xs.shape
    heads = channels // head_dim
    x, B, C = randn(total, channels + 2 * state).split([channels, state, state], dim=-1)
    x, B, C = x.unflatten(-1, (heads, head_dim)), B.unflatten(-1, (1, state)), C.unflatten(-1, (1, state))
    dt = randn(total, heads, scale=0.5)
    A = -torch.exp(randn(heads, dtype=torch.float32, scale=0.5))
    D, dt_bias = randn(heads, dtype=torch.float32), randn(heads, dtype=torch.float32, scale=0.5) - 3
    ssm_state = randn(b.ssm_state0.shape[0], heads, head_dim, state, dtype=torch.float32)
    out = torch.empty_like(x)
    shape = f"{b.shape.split(', ')[0]}, H={heads} P={head_dim} N={state}"

    def run(**knobs):
        return ssd_varlen_scan_fwd(
            x, dt, A, B, C, D, ssm_state, b.cu_seqlens, b.slots, b.has_initial, 256, out, dt_bias=dt_bias,
            dt_softplus=True, **knobs,
        )  # fmt: skip

    # Chunks of 128 store half the states (the walk's [chunks, H, P, N], more than the scan's other bytes at 64); the
    # split walk takes the products off the chain of chunks (varlen.py).
    combos = [{"walk_p": 16, "walk_n": 32}, {"walk_p": 16, "walk_warps": 2}, {"tile": 32}, {"tile": 128},
              {"tile": 128, "out_n": 32}, {"tile": 128, "out_p": 32, "out_warps": 8}, {"split_walk": True},
              {"split_walk": True, "walk_p": 64, "walk_n": 128}, {"split_walk": True, "tile": 128}]  # fmt: skip
    rows = sweep("ssd varlen", shape, run, SSD_FWD_KNOBS + combos) + kernel_breakdown("ssd varlen", shape, run)

    # The anchor: the training forward on the same tokens as one row (the same walk and outputs algorithm with the
    # step precomputed, no slots), in this process: at 1 x 8192 it took 0.235 ms where the serving scan took 0.396.
    step = F.softplus(dt.float() + dt_bias)

    def training_forward():
        return ssd_chunk_scan_fn(x[None], step[None], A, B[None], C[None], D)

    with torch.no_grad():
        rows.append(Row("ssd varlen", "anchor: training forward, one row", shape, median_ms(training_forward)))
        rows += kernel_breakdown("ssd fwd (training)", shape, training_forward)
    return rows


def bench_prefill_scan_sweep(args) -> list[Row]:
    """The serving scan (`selective_scan_varlen_fwd`) alone at the prefill shape (`--prefill-*`, `--serve-channels`;
    the serving benchmark's 8192-token steps: --prefill-seqs 1 --prefill-seq-len 8192 --serve-channels 2048): its
    launch settings, one knob at a time, then combinations."""
    from modeling.ops.selective_scan.interface import selective_scan_varlen_fwd

    batch = prefill_batch(args)
    u = F.silu(batch.xs)  # the conv's output stands in: the scan's timing does not depend on its values
    out, ssm_state = torch.empty_like(u), batch.ssm_state0.clone()
    max_len = args.prefill_seq_len

    def run(**knobs):
        return selective_scan_varlen_fwd(
            u, batch.dt, batch.A, batch.B, batch.C, batch.D, batch.z, ssm_state, batch.cu_seqlens, batch.slots,
            batch.has_initial, out, max_seq_len=max_len, **batch.dt_args, **knobs,
        )  # fmt: skip

    one_knob = one_knob_at_a_time(
        {"chunk": [64, 256, 512, 2048], "block_e": [8, 16, 64], "num_warps": [2, 4], "unroll": [2, 4]}
    )
    combos = [{"block_e": 16, "chunk": 256}, {"block_e": 16, "chunk": 512}, {"block_e": 64, "num_warps": 1},
              {"block_e": 64, "num_warps": 1, "chunk": 64}, {"block_e": 64, "num_warps": 2, "chunk": 256},
              {"chunk": 256, "unroll": 2}]  # fmt: skip
    rows = sweep("scan varlen", batch.shape, run, one_knob + combos)
    # Where the default's time goes: stage 0, the chunk combine, stage 1 (forward.py).
    return rows + kernel_breakdown("scan varlen", batch.shape, run)


def bench_sweeps(args) -> list[Row]:
    from modeling.ops.causal_conv1d.interface import causal_conv1d_bwd, causal_conv1d_fwd
    from vllm_integration.ops.hybrid_decode.interface import hybrid_decode
    from vllm_integration.ops.paged_attention.interface import paged_window_attention

    rows = []
    batch, seq_len, channels = args.scan_batch, args.scan_seq_len, args.scan_channels
    shape = f"B={batch} T={seq_len} E={channels} N=16"
    xz = randn(batch, seq_len, 2 * channels)
    x, weight, bias = xz[..., :channels], randn(channels, 4, scale=0.5), randn(channels)
    conv_fwd_grid = {"block_t": [16, 64], "block_e": [64, 256], "num_warps": [4, 16]}
    conv_bwd_grid = {"block_t": [4, 16], "block_e": [32, 128], "num_warps": [2, 4], "rows_per_program": [64, 1024]}
    rows += sweep(
        "sweep conv fwd", shape, lambda **k: causal_conv1d_fwd(x, weight, bias, "silu", **k),
        one_knob_at_a_time(conv_fwd_grid),
    )  # fmt: skip
    rows += sweep(
        "sweep conv bwd", shape, lambda **k: causal_conv1d_bwd(x, weight, bias, x, "silu", **k),
        one_knob_at_a_time(conv_bwd_grid),
    )  # fmt: skip

    H, KVH, D, block_size, window = args.heads, args.kv_heads, args.head_dim, args.block_size, args.window
    num_seqs, attn_len = args.attn_seqs, args.attn_seq_len
    key_cache, value_cache, block_table = paged_kv([attn_len] * num_seqs, KVH, D, block_size)
    query = randn(num_seqs * attn_len, H, D)
    seq_lens = torch.full((num_seqs,), attn_len, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(0, num_seqs * attn_len + 1, attn_len, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(query)
    rows += sweep(
        "sweep attn",
        f"{num_seqs} x {attn_len}, W={window}",
        lambda **k: paged_window_attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                           D**-0.5, window, out=out, max_query_len=attn_len, max_seq_len=attn_len, **k),
        one_knob_at_a_time({"block_q": [8, 64], "block_keys": [32, 128], "num_warps": [4], "num_stages": [2, 4]}),
    )  # fmt: skip

    decode_batch, context, E = args.decode_batch, args.decode_context, args.serve_channels
    dec_lens = torch.full((decode_batch,), context, dtype=torch.int32, device=DEVICE)
    key_cache, value_cache, block_table = paged_kv([context] * decode_batch, KVH, D, block_size)
    q1, attn_out = randn(decode_batch, H, D), torch.empty(decode_batch, H, D, dtype=torch.bfloat16, device=DEVICE)
    state = randn(decode_batch, E, 16, dtype=torch.float32)
    idx = torch.arange(decode_batch, dtype=torch.int32, device=DEVICE)
    u, dt, z, ssm_out = randn(decode_batch, E), randn(decode_batch, E), randn(decode_batch, E), randn(decode_batch, E)
    Bm, Cm = randn(decode_batch, 16), randn(decode_batch, 16)
    A = -torch.exp(randn(E, 16, dtype=torch.float32))
    Dv, dt_bias = randn(E, dtype=torch.float32), randn(E, dtype=torch.float32)
    rows += sweep(
        "sweep decode",
        f"batch {decode_batch}, ctx {context}, W={window}",
        lambda **k: hybrid_decode(q1, key_cache, value_cache, block_table, dec_lens, D**-0.5, window, attn_out, state,
                                  u, dt, A, Bm, Cm, Dv, z, dt_bias, idx, ssm_out, **k),
        one_knob_at_a_time({
            "block_keys": [32, 128], "num_splits": [2, 4], "num_warps": [8], "num_stages": [3, 4],
            "block_e": [64, 256],
        }),
    )  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------------------------------

SECTIONS: dict[str, Callable] = {
    "scan": bench_scan,
    "conv": bench_conv,
    "ssd": bench_ssd,
    "prefill": bench_prefill,
    "attention": bench_attention,
    "decode": bench_decode,
    "step": bench_step,
    "train": bench_train_step,
    "sweep": bench_sweeps,
    "scan_sweep": bench_scan_sweep,
    "ssd_sweep": bench_ssd_sweep,
    "prefill_scan_sweep": bench_prefill_scan_sweep,
    "ssd_varlen_sweep": bench_ssd_varlen_sweep,
}
CEILINGS: dict[str, float] = {}


def format_table(rows: list[Row], ceilings: dict) -> str:
    header = f"{'section':<14} {'variant':<40} {'shape':<44} {'ms':>9} {'rate':>14} {'% ceil':>7} {'rel err':>9}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        rate, share = "", ""
        if r.bytes:
            gbps = r.bytes / r.ms / 1e6
            rate, share = f"{gbps:,.0f} GB/s", f"{100 * gbps / ceilings['copy_GBps']:.0f}%"
        elif r.flops:
            tflops = r.flops / r.ms / 1e9
            rate, share = f"{tflops:,.1f} TFLOP/s", f"{100 * tflops / ceilings['matmul_TFLOPs']:.0f}%"
        err = "" if r.rel_err is None else f"{r.rel_err:.1e}"
        lines.append(
            f"{r.section:<14} {r.variant:<40} {r.shape:<44} {r.ms:>9.3f} {rate:>14} {share:>7} {err:>9}  {r.note}"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default="scan,conv,ssd,prefill,attention,decode,train",
        help=f"comma-separated sections of {list(SECTIONS)}",
    )
    parser.add_argument("--json", help="write the rows and ceilings here")
    parser.add_argument("--scan-batch", type=int, default=4)
    parser.add_argument("--scan-seq-len", type=int, default=4096)
    parser.add_argument("--scan-channels", type=int, default=1024)
    parser.add_argument("--ssd-channels", type=int, default=2048, help="E of the Mamba-2 scan (heads of 64)")
    parser.add_argument("--ssd-state", type=int, default=128)
    parser.add_argument("--ssd-prefill-len", type=int, default=8192, help="tokens of the Mamba-2 prefill row")
    parser.add_argument("--serve-channels", type=int, default=4096, help="E of the serving benchmarks")
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-seq-len", type=int, default=2048)
    parser.add_argument("--attn-seqs", type=int, default=2)
    parser.add_argument("--attn-seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=8192)
    parser.add_argument("--step-batch", type=int, default=8, help="rows of the branch's decode step (step)")
    parser.add_argument("--step-channels", type=int, default=1024, help="E of the branch's decode step (step)")
    parser.add_argument("--step-dt-rank", type=int, default=64, help="R of the branch's decode step (step)")
    parser.add_argument("--train-batch", type=int, default=2)
    parser.add_argument("--train-seq-len", type=int, default=4096)
    parser.add_argument("--train-window", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument(
        "--train-rounds", type=int, default=3, help="rounds of the training-step rows, the order reversed every other"
    )
    parser.add_argument("--train-attn", default="sdpa")
    parser.add_argument("--train-reference", action="store_true", help="also time the PyTorch reference path")
    parser.add_argument("--smoke", action="store_true", help="CPU wiring check (set TRITON_INTERPRET=1, tiny sizes)")
    args = parser.parse_args()
    if args.smoke:  # a CPU run of the whole script at toy sizes, kernels in Triton's interpreter: checks the wiring
        global DEVICE
        DEVICE = "cpu"
        triton.testing.do_bench = lambda fn, **kwargs: (fn(), 1.0)[1]
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py times kernels on a CUDA GPU; none is visible")

    rows, ceilings = measure_ceilings(*((2**16, 64) if args.smoke else ()))
    CEILINGS.update(ceilings)
    for name in args.only.split(","):
        if name not in SECTIONS:
            sys.exit(f"unknown section {name!r}; choose from {list(SECTIONS)}")
        with interpreter_bf16_dot():  # smoke runs: the interpreter's bf16 products (a no-op on the GPU)
            section_rows = SECTIONS[name](args)
        rows += section_rows
        print(format_table(section_rows, ceilings), flush=True)
    info = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "ceilings": ceilings, "rows": [asdict(r) for r in rows]}))
    print(f"\n{info}\nceilings: {ceilings}")
    print(format_table(rows, ceilings))


if __name__ == "__main__":
    main()
