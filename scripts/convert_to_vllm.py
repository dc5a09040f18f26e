"""Convert a Transformers `save_pretrained` checkpoint of the hybrid model into the checkpoint vLLM loads.

    python scripts/convert_to_vllm.py HF_DIR OUT_DIR [--dtype bfloat16|float16|float32] [--force]

What changes (vLLM's layout, nothing of the function):
  * q/k/v_proj are fused into `self_attn.qkv_proj`, gate/up_proj into `mlp.gate_up_proj`;
  * the SSM's in_proj/out_proj become `self_attn.in_proj`/`self_attn.out_proj` (projections beside qkv and o_proj),
    its stateful part moves under the attention layer: `self_attn.attn.ssm.{conv1d_weight, conv1d_bias, x_proj,
    dt_proj, A, D}`, with the conv weight squeezed to `[E, K]`;
  * `A = -exp(A_log)` is computed here, once, in fp32 (vLLM loads A as is); A and D stay fp32;
  * every other tensor is cast to `--dtype` (default: the checkpoint's own).
Every tensor is checked first (present, expected shape, floating point, finite, nothing unknown). The output is
written to a temporary directory next to OUT_DIR and renamed at the end; OUT_DIR is never overwritten without
`--force`. Tokenizer and generation files are copied.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configuration import HybridConfig  # noqa: E402
from modeling import HybridForCausalLM  # noqa: E402
from vllm_integration.layout import FUSED_PROJECTIONS, vllm_tensor  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP32_TENSORS = (".A", ".D")
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


class ConversionError(Exception):
    """A problem with the input; its message is the one line the user sees."""


def load_config(hf_dir: Path) -> HybridConfig:
    config_path = hf_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{config_path} not found: not a save_pretrained checkpoint") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"cannot read {config_path}: {error}") from None
    if raw.get("model_type") != HybridConfig.model_type:
        raise ConversionError(f"{config_path}: model_type is {raw.get('model_type')!r}, expected 'hybrid'")
    try:
        config = HybridConfig.from_dict(raw)
    except ValueError as error:
        raise ConversionError(f"{config_path}: {error}") from None
    if not config.use_ssm_branch:
        raise ConversionError(f"{config_path}: use_ssm_branch is false; the vLLM model serves the hybrid only")
    return config


def load_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index_path = hf_dir / "model.safetensors.index.json"
    if index_path.exists():
        try:
            files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as error:
            raise ConversionError(f"cannot read {index_path}: {error}") from None
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"no model.safetensors (or its index) in {hf_dir}")
    tensors = {}
    for file in files:
        try:
            tensors.update(load_file(hf_dir / file))
        except (OSError, SafetensorError) as error:
            raise ConversionError(f"cannot read {hf_dir / file}: {error}") from None
    return tensors


def expected_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """The tensors `save_pretrained` writes for this config, from the model itself (on the meta device)."""
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def validate(tensors: dict[str, torch.Tensor], config: HybridConfig) -> None:
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConversionError(
            f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ConversionError(
            f"unknown tensor {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    for name, tensor in tqdm(tensors.items(), desc="checking", unit="tensor"):
        if tuple(tensor.shape) != expected[name]:
            raise ConversionError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
        if not tensor.is_floating_point():
            raise ConversionError(f"{name} has dtype {tensor.dtype}, expected a floating-point dtype")
        if not torch.isfinite(tensor).all():
            raise ConversionError(f"{name} holds NaN or infinite values")


def to_vllm(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fuses q/k/v and gate/up, maps every other tensor with the loader's own rules (`vllm_tensor`), casts."""
    out = {}
    for name, tensor in tqdm(tensors.items(), desc="converting", unit="tensor"):
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


def convert(hf_dir: Path, out_dir: Path, dtype_name: str | None, force: bool) -> None:
    if out_dir.exists() and not force:
        raise ConversionError(f"{out_dir} exists; pass --force to replace it")
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir} is not a directory")
    config = load_config(hf_dir)
    tensors = load_tensors(hf_dir)
    validate(tensors, config)
    dtype = DTYPES[dtype_name] if dtype_name else tensors["model.embed_tokens.weight"].dtype
    converted = to_vllm(tensors, dtype)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as error:
        raise ConversionError(f"cannot write next to {out_dir}: {error}") from None
    try:
        save_file(converted, staging / "model.safetensors", metadata={"format": "pt"})
        config.dtype = dtype
        config.architectures = ["HybridForCausalLM"]
        config.save_pretrained(staging)
        for name in COPIED_FILES:
            if (hf_dir / name).exists():
                shutil.copy2(hf_dir / name, staging / name)
        if out_dir.exists():  # --force: swap the new directory in, putting the old one back if that fails
            previous = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, previous / out_dir.name)
            try:
                os.replace(staging, out_dir)
            except OSError:
                os.replace(previous / out_dir.name, out_dir)
                raise
            finally:
                shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except OSError as error:
        raise ConversionError(f"cannot write {out_dir}: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the checkpoint's)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        convert(args.hf_dir, args.out_dir, args.dtype, args.force)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote the vLLM checkpoint to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
