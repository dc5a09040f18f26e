"""Compiles every Triton kernel the project launches for an H100/H200 (sm_90), on a machine without a GPU: run as
`python tests/compile_for_hopper.py` (TRITON_INTERPRET unset), it prints one `COMPILED <kernel>` line per compiled
variant and exits non-zero on the first kernel that does not compile.

Triton's interpreter, which runs the kernel tests on CPU machines, executes a kernel as Python and never type-checks
it as the compiler does (a jit function whose returns differ in dtype runs there and fails to compile on the GPU).
Here every launch goes through the real compiler instead: `JITFunction.run` is replaced by one that specializes the
arguments as a launch would (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16) and compiles for
sm_90 down to a cubin (Triton carries ptxas), launching nothing. The launchers themselves run on CPU tensors, so each
case below is a real call path: the model's training step and decode step, and the serving kernels with the dtypes
vLLM hands them (bf16 activations over bf16 and fp8 KV caches)."""

import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOPPER = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(HOPPER)


def hopper_binder(kernel: JITFunction):
    """`JITFunction.run`'s binder for HOPPER: a launch's arguments -> (bound arguments, specialization, options), the
    specialization and options being what Triton keys its compiled variants by (dtypes, 16-byte alignment, integers
    equal to 1 or divisible by 16, constexprs; num_warps and the other launch options)."""
    return create_function_from_signature(kernel.signature, kernel.params, BACKEND)


def compile_instead_of_launching(kernel: JITFunction, *args, grid, warmup, **kwargs):
    """`JITFunction.run`'s specialization and compile steps for HOPPER; the kernel is not launched."""
    bound_args, specialization, options = hopper_binder(kernel)(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(BACKEND, kwargs, bound_args, specialization, options)
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)
    print(f"COMPILED {kernel.__name__}", flush=True)


def model_training_and_decode_steps():
    """The Transformers model on its kernels, bf16: a training step (conv and scan, forward and backward, packed rows
    too) and cached one-token steps (the fused branch step, `mamba_inner_step`)."""
    from configuration import HybridConfig
    from modeling import HybridForCausalLM
    from modeling.history import mamba1

    mamba1.Mamba1Branch._ops_for = lambda self, hidden: mamba1.KERNEL_OPS
    config = HybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, ssm_state_size=16, max_position_embeddings=512,
    )  # fmt: skip
    model = HybridForCausalLM(config).to(torch.bfloat16).train()
    input_ids = torch.randint(3, 128, (2, 256))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    packed = torch.cat([torch.arange(100), torch.arange(156)])[None]  # two sequences in one row (seq_idx)
    model(input_ids=input_ids[:1], position_ids=packed, labels=input_ids[:1]).loss.backward()
    with torch.no_grad():
        model.eval().generate(input_ids[:, :8], max_new_tokens=2, do_sample=False)


def serving_ssm_kernels():
    """The serving branches' prefill and decode kernels but the fused decode (`Mamba1Branch.triton_ops`, and the conv
    of `Mamba2Branch.triton_ops`, in vllm_integration/history) as their layers call them: bf16 activations (column
    views of the in_proj and x_proj outputs), the raw dt with its bias, fp32 state cache slots, the decode conv with
    the first-token flags and on vLLM's [slots, K-1, C] conv state as well."""
    from modeling.ops.causal_conv1d.interface import causal_conv1d_update, causal_conv1d_varlen_fwd
    from modeling.ops.selective_scan.interface import selective_scan_varlen_fwd, selective_state_update

    tokens, channels, state, slots = 40, 64, 16, 6
    xz = torch.randn(tokens, 2 * channels, dtype=torch.bfloat16)
    xs, z = xz[:, :channels], xz[:, channels:]
    dbc = torch.randn(tokens, 4 + 2 * state, dtype=torch.bfloat16)
    B, C = dbc[:, 4 : 4 + state], dbc[:, 4 + state :]
    dt = torch.randn(tokens, channels, dtype=torch.bfloat16)
    weight, bias = torch.randn(channels, 4, dtype=torch.bfloat16), torch.randn(channels, dtype=torch.bfloat16)
    A, D, dt_bias = -torch.rand(channels, state), torch.randn(channels), torch.randn(channels)
    conv_state = torch.randn(slots, channels, 3, dtype=torch.bfloat16)
    ssm_state = torch.randn(slots, channels, state)
    cu_seqlens = torch.tensor([0, 15, 40], dtype=torch.int32)
    state_indices, has_initial = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False])
    u = torch.empty(tokens, channels, dtype=torch.bfloat16)
    out = torch.empty_like(u)
    causal_conv1d_varlen_fwd(xs, weight, bias, conv_state, cu_seqlens, state_indices, has_initial, "silu", u)
    selective_scan_varlen_fwd(
        u, dt, A, B, C, D, z, ssm_state, cu_seqlens, state_indices, has_initial, out=out, dt_bias=dt_bias,
        dt_softplus=True, max_seq_len=25,
    )  # fmt: skip
    decodes = torch.tensor([0, 4, -1], dtype=torch.int32)
    causal_conv1d_update(xs[:3], weight, bias, conv_state, decodes, "silu", u[:3])
    vllm_layout = torch.randn(slots, 3, channels, dtype=torch.bfloat16).transpose(1, 2)
    first_tokens = torch.tensor([True, False, True])
    causal_conv1d_update(xs[:3], weight, bias, vllm_layout, decodes, "silu", u[:3], has_initial_state=first_tokens)
    selective_state_update(ssm_state, u[:3], dt[:3], A, B[:3], C[:3], D, z[:3], dt_bias, decodes, out[:3])


def serving_attention_kernels():
    """The paged window attention (a mixed batch) and the fused decodes of both branches (split along the keys), bf16
    queries over a bf16 cache and over vLLM's fp8 (e4m3) cache with its scales."""
    from tools.paged_cache import paged_kv_cache
    from vllm_integration.ops.hybrid_decode.interface import hybrid_decode, hybrid_decode_ssd
    from vllm_integration.ops.paged_attention.interface import paged_window_attention

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, page, window = 8, 2, 64, 16, 24
    scales = {"k_scale": torch.tensor(0.5), "v_scale": torch.tensor(2.0)}
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        fp8 = scales if cache_dtype == torch.float8_e4m3fn else {}
        seq_lens, q_lens = [50, 9, 30], [1, 1, 30]
        key_cache, value_cache, table = paged_kv_cache(
            seq_lens, window, page, kv_heads, head_dim, cache_dtype, "triton", g, q_lens=q_lens, device="cpu"
        )
        query = torch.randn(sum(q_lens), heads, head_dim, dtype=torch.bfloat16)
        starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        paged_window_attention(
            query, key_cache, value_cache, table, starts, torch.tensor(seq_lens, dtype=torch.int32), head_dim**-0.5,
            window, max_query_len=max(q_lens), max_seq_len=50, **fp8,
        )  # fmt: skip
        batch, channels, state = 3, 64, 16
        key_cache, value_cache, table = paged_kv_cache(
            [50, 9, 30], window, page, kv_heads, head_dim, cache_dtype, "triton", g, device="cpu"
        )
        query = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16)
        xz = torch.randn(batch, 2 * channels, dtype=torch.bfloat16)
        dbc = torch.randn(batch, 4 + 2 * state, dtype=torch.bfloat16)
        hybrid_decode(
            query, key_cache, value_cache, table, torch.tensor([50, 9, 30], dtype=torch.int32), head_dim**-0.5,
            window, torch.empty_like(query), torch.randn(5, channels, state), xz[:, :channels],
            torch.randn(batch, channels, dtype=torch.bfloat16), -torch.rand(channels, state), dbc[:, 4 : 4 + state],
            dbc[:, 4 + state :], torch.randn(channels), xz[:, channels:], torch.randn(channels),
            torch.tensor([2, 0, -1], dtype=torch.int32), torch.empty(batch, channels, dtype=torch.bfloat16),
            num_splits=2, **fp8,
        )  # fmt: skip
        # With a Mamba-2 branch: 4 heads of 32 channels in 2 groups, N 16, x, B and C views of the conv's output.
        xbc = torch.randn(batch, 4 * 32 + 2 * 2 * state, dtype=torch.bfloat16)
        x, B, C = xbc[:, :128].unflatten(-1, (4, 32)), *xbc[:, 128:].unflatten(-1, (2, 2, state)).unbind(1)
        hybrid_decode_ssd(
            query, key_cache, value_cache, table, torch.tensor([50, 9, 30], dtype=torch.int32), head_dim**-0.5,
            window, torch.empty_like(query), torch.randn(5, 4, 32, state), x,
            torch.randn(batch, 4, dtype=torch.bfloat16), -torch.rand(4), B, C, torch.randn(4), torch.tensor([2, 0, 4], dtype=torch.int32),
            torch.tensor([True, False, True]), dt_bias=torch.randn(4), dt_softplus=True, out=torch.empty_like(x),
            num_splits=2, **fp8,
        )  # fmt: skip


def mamba2_decode_kernel():
    """The Mamba-2 branch's decode update as generate() on a bf16 model calls it: x, B and C bf16 views of the conv's
    output, the step in fp32, D in bf16, over an fp32 and a bf16 state cache (rows owning their slots), and with
    scattered slots and first-token flags."""
    from modeling.ops.ssd.decode import ssd_state_update

    rows, heads, head_dim, groups, state = 3, 4, 64, 1, 128
    conv_out = torch.randn(rows, heads * head_dim + 2 * groups * state, dtype=torch.bfloat16)
    x = conv_out[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    B, C = conv_out[:, heads * head_dim :].unflatten(-1, (2, groups, state)).unbind(1)
    step, A, D = torch.rand(rows, heads), -torch.rand(heads), torch.randn(heads, dtype=torch.bfloat16)
    for cache_dtype in (torch.float32, torch.bfloat16):
        ssd_state_update(torch.zeros(rows, heads, head_dim, state, dtype=cache_dtype), x, step, A, B, C, D)
    slots, has_initial_state = torch.tensor([3, 0, 1], dtype=torch.int32), torch.tensor([True, False, True])
    ssd_state_update(torch.zeros(5, heads, head_dim, state), x, step, A, B, C, D, slots, has_initial_state)


def mamba2_training_scan():
    """Mamba-2's chunked scan as the branch's training step calls it: x, B and C bf16 views of the conv's output
    (the model's shapes: heads of 64 channels, N 128, one group and eight), the step in fp32, forward and backward;
    with an initial state, packed rows and the final state's gradient, and without them; and fp32 inputs."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    batch, length, heads, head_dim, state = 2, 200, 8, 64, 128
    seq_idx = (torch.arange(length) >= 70).to(torch.int32).expand(batch, length).contiguous()
    for groups, dtype, packed in ((1, torch.bfloat16, True), (8, torch.bfloat16, False), (1, torch.float32, True)):
        conv_out = torch.randn(batch, length, heads * head_dim + 2 * groups * state, dtype=dtype)
        x = conv_out[..., : heads * head_dim].unflatten(-1, (heads, head_dim)).requires_grad_()
        B, C = conv_out[..., heads * head_dim :].unflatten(-1, (2, groups, state)).unbind(2)
        dt, A, D = torch.rand(batch, length, heads), -torch.rand(heads), torch.randn(heads)
        initial_state = torch.randn(batch, heads, head_dim, state) if packed else None
        y, final_state = ssd_chunk_scan_fn(x, dt, A, B, C, D, initial_state, seq_idx if packed else None)
        (y.float().sum() + (final_state.sum() if packed else 0)).backward()


def mamba2_serving_scan():
    """Mamba-2's packed prefills over state slots (varlen.py) as the served branch would call them: bf16 x, B and C
    views of the conv's output, the raw bf16 dt (a column view of in_proj's output) with its fp32 bias and softplus,
    an fp32 and a bf16 state cache."""
    from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

    tokens, heads, head_dim, state = 200, 8, 64, 128
    conv_out = torch.randn(tokens, heads * head_dim + 2 * state, dtype=torch.bfloat16)
    x = conv_out[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    B, C = conv_out[:, heads * head_dim :].unflatten(-1, (2, 1, state)).unbind(1)
    dt = torch.randn(tokens, heads + 8, dtype=torch.bfloat16)[:, :heads]
    A, D, dt_bias = -torch.rand(heads), torch.randn(heads), torch.randn(heads)
    bounds, slots = torch.tensor([0, 70, 71, 200], dtype=torch.int32), torch.tensor([3, 0, 1], dtype=torch.int32)
    # Served: an fp32 and a bf16 cache; then the variants bench_kernels' ssd_varlen_sweep times (other chunk
    # lengths, the walk split in two).
    sweep_variants = ({"tile": 32}, {"tile": 128}, {"split_walk": True}, {"split_walk": True, "tile": 128})
    cases = [(torch.float32, {}), (torch.bfloat16, {}), *((torch.bfloat16, variant) for variant in sweep_variants)]
    for cache_dtype, variant in cases:
        cache = torch.randn(4, heads, head_dim, state, dtype=cache_dtype)
        ssd_varlen_scan_fwd(
            x, dt, A, B, C, D, cache, bounds, slots, torch.tensor([True, False, True]), 256, dt_bias=dt_bias,
            dt_softplus=True, **variant,
        )  # fmt: skip


def mamba2_gated_norm():
    """Mamba-2's gated norm as the branch calls it: bf16 y, z a column view of in_proj's output, fp32 weight, groups of
    a model's width and of a non-power-of-two one; forward and backward."""
    from modeling.ops.ssd.gated_norm import gated_rms_norm_bwd, gated_rms_norm_fwd

    for channels, groups in ((2048, 1), (96, 3)):
        zx = torch.randn(2, 50, 2 * channels + 8, dtype=torch.bfloat16)
        y, z = torch.randn(2, 50, channels, dtype=torch.bfloat16), zx[..., :channels]
        weight = torch.randn(channels)
        gated_rms_norm_fwd(y, z, weight, channels // groups, 1e-5)
        gated_rms_norm_bwd(y, z, weight, channels // groups, 1e-5, torch.randn_like(y))


CASES = (
    model_training_and_decode_steps, mamba2_decode_kernel, mamba2_training_scan, mamba2_serving_scan, mamba2_gated_norm,
    serving_ssm_kernels, serving_attention_kernels,
)  # fmt: skip

if __name__ == "__main__":
    JITFunction.run = compile_instead_of_launching
    for case in CASES:
        print(f"CASE {case.__name__}", flush=True)
        case()
