"""What the checkpoint scripts (convert_to_vllm.py, upcycle.py) share: reading a `save_pretrained` directory's config
and safetensors (sharded or not), checking tensors against the shapes a model expects, and writing the output
directory atomically. Each problem is a `CheckpointError` whose message is the one `error:` line the user sees."""

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

# Files beside the weights that a derived checkpoint keeps: the tokenizer and the generation defaults.
SIDE_FILES = (
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


class CheckpointError(Exception):
    """A problem with the input or the output; its message is the one line the user sees."""


def read_config_json(checkpoint_dir: Path) -> dict:
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a directory")
    config_path = checkpoint_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path} not found: not a save_pretrained checkpoint") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {config_path}: {error}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_path} does not hold a JSON object")
    return raw


def load_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model.safetensors`, or of the shards its index names."""
    index_path = checkpoint_dir / "model.safetensors.index.json"
    if index_path.exists():
        try:
            files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as error:
            raise CheckpointError(f"cannot read {index_path}: {error}") from None
    elif (checkpoint_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors (or its index) in {checkpoint_dir}")
    tensors = {}
    for file in files:
        try:
            tensors.update(load_file(checkpoint_dir / file))
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"cannot read {checkpoint_dir / file}: {error}") from None
    return tensors


def state_dict_shapes(model_factory: Callable[[], torch.nn.Module], tied_lm_head: bool) -> dict[str, tuple]:
    """The tensors `save_pretrained` writes for the model `model_factory` builds (on the meta device)."""
    with torch.device("meta"):
        model = model_factory()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied_lm_head:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], what: str = "") -> None:
    """Every expected tensor present, nothing unknown, shapes as expected, floating point and finite."""
    where = f" in {what}" if what else ""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more}{where}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"unknown tensor {unknown[0]}{more}{where}")
    for name, tensor in tqdm(tensors.items(), desc="checking", unit="tensor"):
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}{where}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{name} has dtype {tensor.dtype}, expected a floating-point dtype{where}")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{name} holds NaN or infinite values{where}")


def copy_side_files(source_dir: Path, target_dir: Path) -> None:
    for name in SIDE_FILES:
        if (source_dir / name).exists():
            shutil.copy2(source_dir / name, target_dir / name)


def write_directory_atomically(out_dir: Path, write: Callable[[Path], None], force: bool) -> None:
    """Calls `write(staging)` on a fresh directory next to `out_dir`, then renames it to `out_dir`: a failure leaves
    nothing behind, and an existing `out_dir` is replaced only with `force` (and put back if the swap fails)."""
    if out_dir.exists() and not force:
        raise CheckpointError(f"{out_dir} exists; pass --force to replace it")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as error:
        raise CheckpointError(f"cannot write next to {out_dir}: {error}") from None
    try:
        write(staging)
        if out_dir.exists():
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
        raise CheckpointError(f"cannot write {out_dir}: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
