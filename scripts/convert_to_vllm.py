"""Convert a Transformers `save_pretrained` checkpoint of the hybrid model into the checkpoint vLLM loads.

    python scripts/convert_to_vllm.py HF_DIR OUT_DIR [--dtype bfloat16|float16|float32] [--force]

What changes (vLLM's layout, nothing of the function):
  * q/k/v_proj are fused into `self_attn.qkv_proj`, gate/up_proj into `mlp.gate_up_proj`;
  * the SSM's in_proj/out_proj become `self_attn.in_proj`/`self_attn.out_proj` (projections beside qkv and o_proj),
    its stateful part moves under the attention layer: `self_attn.attn.ssm.{conv1d_weight, conv1d_bias, x_proj,
    dt_proj, A, D}`, with the conv weight squeezed to `[E, K]`;
  * `A = -exp(A_log)` is computed here, once, in fp32 (vLLM loads A as is); A and D stay fp32;
  * every other tensor is cast to `--dtype` (default: the checkpoint's own; a float64 checkpoint is written as
    float32, with a note: vLLM serves no float64).
Inputs are float32, bfloat16 or float16 (or float64) tensors, in one file or in shards with their index. Every tensor
is checked first (present, expected shape, dtype, finite, nothing unknown; in one shard only, the one the index names),
and so is every tensor converted (finite after A = -exp(A_log) and the cast: a weight beyond float16's range is
refused, not written as inf). The output is written to a temporary directory next to OUT_DIR, with the mode `mkdir`
gives, and renamed at the end; OUT_DIR is never overwritten without `--force`, and is never the input, inside it or
above it. Tokenizer and generation files are copied. A bad input is refused with one `error:` line and exit code 2.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint_io import (  # noqa: E402
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

from configuration import HybridConfig  # noqa: E402
from modeling import HybridForCausalLM  # noqa: E402
from vllm_integration.layout import FUSED_PROJECTIONS, vllm_tensor  # noqa: E402

FP32_TENSORS = (".A", ".D")


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
    return config


def expected_shapes(config: HybridConfig, config_path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors `save_pretrained` writes for this config (building the model on the meta device: a config that
    describes no model is refused here)."""
    return state_dict_shapes(lambda: HybridForCausalLM(config), config.tie_word_embeddings, str(config_path))


def to_vllm(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fuses q/k/v and gate/up, maps every other tensor with the loader's own rules (`vllm_tensor`), casts."""
    out = {}
    for name, tensor in tensors.items():
        fused = next(
            (
                (into, [part for part, _ in parts])
                for into, parts in FUSED_PROJECTIONS.items()
                if any(part in name for part, _ in parts)
            ),
            None,
        )
        if fused is None:
            name, tensor = vllm_tensor(name, tensor)
        elif fused[1][0] in name:  # the first part stands for the fused projection; the others join it here
            into, parts = fused
            tensor = torch.cat([tensors[name.replace(parts[0], part)] for part in parts])
            name = name.replace(parts[0], into)
        else:
            continue
        out[name] = (tensor.float() if name.endswith(FP32_TENSORS) else tensor.to(dtype)).contiguous()
    return out


def check_converted(converted: dict[str, torch.Tensor]) -> None:
    """What is written is finite. The input was checked finite, so a non-finite tensor here overflowed: in
    A = -exp(A_log) (fp32) or in the cast to the output dtype."""
    for name, tensor in converted.items():
        if torch.isfinite(tensor).all():
            continue
        dtype = str(tensor.dtype).removeprefix("torch.")
        if name.endswith(".A"):
            limit = math.log(torch.finfo(torch.float32).max)
            raise CheckpointError(f"{name} = -exp(A_log) overflows float32 (A_log holds values above {limit:.1f})")
        hint = "; pass --dtype bfloat16 or float32" if tensor.dtype == torch.float16 else ""
        raise CheckpointError(f"{name} overflows {dtype} (values beyond ±{torch.finfo(tensor.dtype).max:.5g}){hint}")


def convert(hf_dir: Path, out_dir: Path, dtype_name: str | None, force: bool) -> None:
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the checkpoint's)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        convert(args.hf_dir, args.out_dir, args.dtype, args.force)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote the vLLM checkpoint to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
