"""The launch toolkit every Triton op shares: argument checks with one policy (and one message form), the no-window
sentinel, the device facts the launchers size their grids from, math that `triton.language` lacks (or lacks the
accuracy of), and the fix the CPU interpreter needs for bf16 products.

Policy for index tensors (cu_seqlens, state slots, block tables, sequence lengths, seq_idx): int32 or int64, on the
device of the data, contiguous (kernels read entry i at `pointer + i`, so a strided view such as a column of a wider
table would read wrong entries); the kernels widen them to int64 before computing offsets. Block tables are the one
exception (`check_table`): only their rows need be contiguous. Flags (has_initial_state) are bool.
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

# The window of full-attention layers: every key precedes its query by less than this many positions.
NO_WINDOW = 2**31 - 1

INDEX_DTYPES = (torch.int32, torch.int64)


def window_or_unbounded(window: int | None) -> int:
    """The kernels' window argument: docs/DESIGN.md's W (query t sees keys t-W < s <= t), or `NO_WINDOW` for None (and
    for a W beyond it, which no context reaches: the argument stays int32). Raises ValueError for W < 1."""
    if window is None:
        return NO_WINDOW
    if window < 1:
        raise ValueError(f"window: expected None or >= 1, got {window}")
    return min(window, NO_WINDOW)


def check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    """An index tensor of `shape` under the policy above (on the device of `like`)."""
    if tuple(tensor.shape) != shape or tensor.dtype not in INDEX_DTYPES or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous int32 or int64 tensor of shape {shape}, got {tensor.dtype} "
            f"{tuple(tensor.shape)} with strides {tensor.stride()}"
        )
    if tensor.device != like.device:
        raise ValueError(f"{name}: expected a tensor on {like.device}, got one on {tensor.device}")


def check_table(name: str, tensor: torch.Tensor, num_rows: int, like: torch.Tensor) -> None:
    """A 2-D index table of `num_rows` rows (a block table) under the policy above, except that the rows may be
    strided: kernels read entry j of row i at `pointer + i * row_stride + j`, so only each row must be contiguous."""
    if not (tensor.dim() == 2 and tensor.shape[0] == num_rows and tensor.dtype in INDEX_DTYPES) or (
        tensor.shape[1] > 1 and tensor.stride(1) != 1
    ):
        raise ValueError(
            f"{name}: expected an int32 or int64 table of {num_rows} contiguous rows, got {tensor.dtype} "
            f"{tuple(tensor.shape)} with strides {tensor.stride()}"
        )
    if tensor.device != like.device:
        raise ValueError(f"{name}: expected a tensor on {like.device}, got one on {tensor.device}")


def check_flags(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A contiguous bool tensor of `shape`."""
    if tuple(tensor.shape) != shape or tensor.dtype != torch.bool or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous bool tensor of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)} "
            f"with strides {tensor.stride()}"
        )


def check_tokens(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A floating-point activation of `shape` whose last dimension is contiguous (row-strided views are fine)."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {tensor.stride()}")


def stride_args(name: str, tensor: torch.Tensor | None, dims: str | tuple[str, ...]) -> dict[str, int]:
    """A kernel's stride arguments `s_{name}_{d}`, one per letter (or name) d of `dims`, the tensor's dimensions
    outermost first, computed once per tensor: a tensor with fewer dimensions is one row of the missing outer ones
    (stride 0: a packed [T, E] batch read as [B, T, E]); None gives zeros (an absent tensor, which the kernel does not
    read). Launch-path code: the names are built once per (name, dims)."""
    names = _stride_names(name, tuple(dims))
    if tensor is None:
        return dict.fromkeys(names, 0)
    strides = tensor.stride()
    missing = len(names) - len(strides)
    if missing < 0:
        raise ValueError(f"{name}: expected at most {len(dims)} dimensions ({dims}), got {tuple(tensor.shape)}")
    return dict(zip(names, (0,) * missing + strides))


@functools.cache
def _stride_names(name: str, dims: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"s_{name}_{d}" for d in dims)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch shapes on the host: `triton.cdiv`'s result without its cost there (in Triton 3.6 it is
    a `ConstexprFunction` that unwraps its arguments, ~2 µs a call; a launch path calls it a few times per kernel)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0, as `triton.next_power_of_2` gives), for block sizes on the host;
    `cdiv` says why not Triton's own. Shifts and ors only, as Triton's: under torch.compile with dynamic shapes a
    token count arrives as a SymInt, which `int.bit_length` would specialise (a recompile per power of two)."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def launch_power_of_2(n: int, floor: int = 1, cap: int | None = None) -> int:
    """The smallest power of 2 >= n, at least `floor` (a power of 2) and at most `cap`, always a plain int: for the
    block sizes and warp counts that reach a kernel as constexpr arguments or `num_warps`, which Dynamo accepts only
    as plain ints. Under torch.compile with dynamic shapes a token count `n` is a SymInt, and `next_power_of_2` of it
    stays symbolic; here each doubling is a comparison, which Dynamo answers by guarding on n's range, so one graph
    serves every length that picks the same block."""
    block = floor
    while (cap is None or block < cap) and block < n:
        block *= 2
    return block


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; 1 on CPU (Triton's interpreter runs programs one at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def softplus(x):
    """softplus(x) = max(x, 0) + log1p(exp(-|x|)) to fp32 accuracy, as torch computes it (which is linear above 20:
    here log1p(exp(-20)) is below half an ulp of x there), in about 17 instructions. tl.log lowers to a precise
    libdevice log (a 12-term polynomial and range reduction, ~50 instructions with the log1p fix-up of w = 1 + e),
    which cost more than the whole recurrence step per channel in the scans' loops. With e = exp(-|x|) in (0, 1]:
        log1p(e) = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ... ),   s = e / (2 + e) in (0, 1/3],
    exact in its first term for small e (no cancellation) and truncated after s^12/13: the next term, s^14/15 <
    (1/9)^7 / 15 = 1.4e-8, is below fp32's half ulp."""
    b_e = tl.exp2(-tl.abs(x) * 1.4426950408889634)
    b_s = b_e / (2.0 + b_e)
    b_s2 = b_s * b_s
    b_p = 1.0 / 11.0 + b_s2 * (1.0 / 13.0)
    b_p = 1.0 / 9.0 + b_s2 * b_p
    b_p = 1.0 / 7.0 + b_s2 * b_p
    b_p = 1.0 / 5.0 + b_s2 * b_p
    b_p = 1.0 / 3.0 + b_s2 * b_p
    b_p = 1.0 + b_s2 * b_p
    return tl.maximum(x, 0.0) + 2.0 * b_s * b_p


@contextlib.contextmanager
def interpreter_bf16_dot():
    """Within it, `tl.dot` of bf16 tiles in Triton's CPU interpreter (TRITON_INTERPRET=1) gives bf16 products: Triton
    3.6's interpreter keeps bf16 as raw uint16 bits and multiplies those bits. The operands are widened to fp32 first
    (exact: bf16 is the top half of fp32), as the tensor cores' bf16 x bf16 -> fp32 products are. Compiled kernels
    are unaffected; outside the interpreter nothing is patched. Entered by the tests (conftest) and by
    `bench_kernels.py --smoke`."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot = InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot_widening_bf16
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = create_dot
