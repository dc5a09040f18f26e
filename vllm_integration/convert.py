"""Convert a Transformers `save_pretrained` checkpoint of the hybrid model into the checkpoint vLLM loads
(`python scripts/convert_to_vllm.py HF_DIR OUT_DIR [--dtype bfloat16|float16|float32] [--force]`, or
`python -m vllm_integration.convert ...` with the same arguments).

What changes (vLLM's layout, nothing of the function):
  * q/k/v_proj are fused into `self_attn.qkv_proj`, gate/up_proj into `mlp.gate_up_proj` (layout.py's
    `STACKED_PROJECTIONS`, in the shard order of vLLM's fused-layer loaders);
  * every tensor is cast to `--dtype` (default: the checkpoint's own; a float64 checkpoint is written as float32,
    with a note on stderr: vLLM serves no float64), except A_log, D and Mamba-2's dt_bias, which stay fp32 as the
    kernels read them.
The SSM tensors keep their Transformers names and values: vLLM's loader renames them and computes A = -exp(A_log)
(layout.py), for a converted checkpoint as for a Transformers one.
Inputs are float32, bfloat16 or float16 (or float64) tensors, in one file or in shards with their index. Every tensor
is checked first (present, expected shape, dtype, finite, nothing unknown; in one shard only, the one the index names),
and so is every tensor converted (finite after the cast, and A = -exp(A_log) finite in fp32: a weight beyond float16's
range is refused, not written as inf). The output is written to a temporary directory next to OUT_DIR, with the mode
`mkdir` gives, and renamed at the end; OUT_DIR is never overwritten without `--force`, and is never the input, inside
it or above it. Tokenizer and generation files are copied. A bad input, or an input or output path that cannot be
resolved (a symlink loop), is refused with one `error:` line and exit code 2.
"""

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from configuration import HybridConfig
from modeling import HybridForCausalLM
from modeling.checkpoint_io import (
    DTYPES,
    CheckpointError,
    check_tensors,
    copy_side_files,
    load_tensors,
    output_dtype,
    read_config_json,
    refuse_output_dir,
    state_dict_shapes,
    write_directory_atomically,
)

from .layout import FP32_TENSORS, SERVED_SSM_TYPES, STACKED_PROJECTIONS, a_from_a_log


def load_config(hf_dir: Path) -> HybridConfig:
    raw = read_config_json(hf_dir)
    config_path = hf_dir / "config.json"
    if raw.get("model_type") != HybridConfig.model_type:
        raise CheckpointError(f"{config_path}: model_type is {raw.get('model_type')!r}, expected 'hybrid'")
    try:
        config = HybridConfig.from_dict(raw)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
    except (KeyError, TypeError, AttributeError) as error:  # a field of a type the config's own code does not expect
        raise CheckpointError(f"{config_path}: not a valid HybridConfig ({type(error).__name__}: {error})") from None
    if not config.use_ssm_branch:
        raise CheckpointError(f"{config_path}: use_ssm_branch is false; the vLLM model serves the hybrid only")
    if config.ssm_type not in SERVED_SSM_TYPES:
        raise CheckpointError(
            f"{config_path}: ssm_type {config.ssm_type!r} is not served by the vLLM plugin yet "
            f"(it serves {', '.join(SERVED_SSM_TYPES)}); the Transformers model runs it"
        )
    return config


def expected_shapes(config: HybridConfig, config_path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors `save_pretrained` writes for this config (building the model on the meta device: a config that
    describes no model is refused here)."""
    return state_dict_shapes(lambda: HybridForCausalLM(config), config.tie_word_embeddings, str(config_path))


def to_vllm(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fuses the stacked projections (their parts concatenated in shard order) and casts every tensor."""
    fused: dict[str, list[torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        part = next((part for part in STACKED_PROJECTIONS if part in name), None)
        if part is None:
            out[name] = tensor
        else:
            fused.setdefault(name.replace(part, STACKED_PROJECTIONS[part][0]), []).append((part, tensor))
    order = list(STACKED_PROJECTIONS)
    for name, parts in fused.items():
        out[name] = torch.cat([tensor for _, tensor in sorted(parts, key=lambda part: order.index(part[0]))])
    return {
        name: (tensor.float() if name.endswith(FP32_TENSORS) else tensor.to(dtype)).contiguous()
        for name, tensor in out.items()
    }


def check_converted(converted: dict[str, torch.Tensor]) -> None:
    """What is written is finite and loads: the input was checked finite, so a non-finite tensor here overflowed in
    the cast to the output dtype; vLLM's loader computes A = -exp(A_log) in fp32, which must not overflow either."""
    for name, tensor in converted.items():
        if name.endswith(".A_log"):
            try:
                a_from_a_log(tensor)
            except ValueError as error:
                raise CheckpointError(f"{name}: {error}") from None
        if torch.isfinite(tensor).all():
            continue
        dtype = str(tensor.dtype).removeprefix("torch.")
        hint = "; pass --dtype bfloat16 or float32" if tensor.dtype == torch.float16 else ""
        raise CheckpointError(f"{name} overflows {dtype} (values beyond ±{torch.finfo(tensor.dtype).max:.5g}){hint}")


def convert_checkpoint(hf_dir: Path, out_dir: Path, dtype_name: str | None = None, force: bool = False) -> None:
    refuse_output_dir(hf_dir, out_dir, force)
    config = load_config(hf_dir)
    expected = expected_shapes(config, hf_dir / "config.json")
    tensors = load_tensors(hf_dir)
    check_tensors(tensors, expected)
    dtype = output_dtype(tensors, dtype_name)
    converted = to_vllm(tensors, dtype)
    check_converted(converted)

    def write(staging: Path) -> None:
        save_file(converted, staging / "model.safetensors", metadata={"format": "pt"})
        config.dtype = dtype
        config.architectures = ["HybridForCausalLM"]
        config.save_pretrained(staging)
        copy_side_files(hf_dir, staging)

    write_directory_atomically(out_dir, write, force)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_to_vllm.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the checkpoint's)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        convert_checkpoint(args.hf_dir, args.out_dir, args.dtype, args.force)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote the vLLM checkpoint to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
