"""What the checkpoint tools (the vLLM converter, vllm_integration/convert.py; the upcycler, modeling/upcycling.py)
share: reading a `save_pretrained` directory's config and safetensors (sharded or not), checking tensors against the
shapes a model expects, and writing the output directory atomically. Each problem is a `CheckpointError` whose message is the one `error:` line the user sees, and the
first: nothing here draws a progress bar that an error could follow."""

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.utils import logging as transformers_logging

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
# The dtypes a checkpoint's tensors may have (float8 and the like would need their scales, which are not read).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_FILE = "model.safetensors.index.json"

# What `--dtype` offers; float64 checkpoints are written as float32.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index: tensor name -> shard file in the same directory."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {index_path}: {error}") from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_path} does not hold a JSON object")
    if "weight_map" not in index:
        raise CheckpointError(f"{index_path} has no weight_map")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: weight_map is not a JSON object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise CheckpointError(f"{index_path}: weight_map gives {name} the file {file!r}, not a file name")
    return weight_map


def load_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model.safetensors`, or of the shards its index names: each tensor in one shard only, the one
    the index says."""
    index_path = checkpoint_dir / INDEX_FILE
    if index_path.exists():
        weight_map = read_weight_map(index_path)
        files = sorted(set(weight_map.values()))
    elif (checkpoint_dir / "model.safetensors").exists():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors (or its index) in {checkpoint_dir}")
    tensors, file_of = {}, {}
    for file in files:
        try:
            shard = load_file(checkpoint_dir / file)
        except (OSError, SafetensorError) as error:
            raise CheckpointError(f"cannot read {checkpoint_dir / file}: {error}") from None
        for name in sorted(shard):
            if name in file_of:
                raise CheckpointError(f"{checkpoint_dir}: {name} is in both {file_of[name]} and {file}")
            file_of[name] = file
        tensors.update(shard)
    if weight_map is not None:
        for name, file in file_of.items():
            if name not in weight_map:
                raise CheckpointError(f"{checkpoint_dir}: {file} holds {name}, which {INDEX_FILE} does not list")
            if weight_map[name] != file:
                raise CheckpointError(
                    f"{checkpoint_dir}: {file} holds {name}, which {INDEX_FILE} puts in {weight_map[name]}"
                )
        for name, file in weight_map.items():
            if name not in file_of:
                raise CheckpointError(f"{checkpoint_dir}: {INDEX_FILE} puts {name} in {file}, which does not hold it")
    return tensors


def state_dict_shapes(
    model_factory: Callable[[], torch.nn.Module], tied_lm_head: bool, what: str = ""
) -> dict[str, tuple]:
    """The tensors `save_pretrained` writes for the model `model_factory` builds (on the meta device). A config that
    its class accepts may still describe no model (RoPE parameters missing a field its `rope_type` needs: a KeyError
    in the RoPE init): what the model's constructor raises for it is a `CheckpointError` naming `what`."""
    try:
        with torch.device("meta"):
            model = model_factory()
    except (KeyError, ValueError, TypeError, AttributeError) as error:
        where = f"{what}: " if what else ""
        raise CheckpointError(f"{where}the model cannot be built from it ({type(error).__name__}: {error})") from None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied_lm_head:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], what: str = "") -> None:
    """Every expected tensor present, nothing unknown, shapes as expected, a float dtype of `FLOAT_DTYPES`, finite."""
    where = f" in {what}" if what else ""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]}{more}{where}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(f"unknown tensor {unknown[0]}{more}{where}")
    supported = ", ".join(str(dtype).removeprefix("torch.") for dtype in FLOAT_DTYPES)
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}{where}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{name} has dtype {tensor.dtype}, expected one of {supported}{where}")
        if not torch.isfinite(tensor).all():
            raise CheckpointError(f"{name} holds NaN or infinite values{where}")


def resolve_path(path: Path) -> Path:
    """`path.resolve()` for a path that may not exist yet (an output), one that cannot be resolved (a symlink loop on
    it or on a directory above it) being a `CheckpointError` naming it: for a loop, Python 3.12 and older raise
    RuntimeError in `resolve` and 3.13 returns the path half-resolved, so `stat` (ELOOP) is what finds it."""
    try:
        path.stat()
    except FileNotFoundError:
        pass
    except OSError as error:
        raise CheckpointError(f"cannot resolve {path}: {error.strerror}") from None
    return path.resolve()


def refuse_output_dir(input_dir: Path, out_dir: Path, force: bool) -> None:
    """Before any work: a path that cannot be resolved is refused, as is an output that is the input, lies inside it,
    or holds it (which `--force` would delete), and an existing one without `force`."""
    source, target = resolve_path(input_dir), resolve_path(out_dir)
    if target == source:
        raise CheckpointError(f"{out_dir} is the input checkpoint itself; write the output elsewhere")
    if target.is_relative_to(source):
        raise CheckpointError(f"{out_dir} is inside the input checkpoint {input_dir}; write the output elsewhere")
    if source.is_relative_to(target):
        raise CheckpointError(f"the input checkpoint {input_dir} is inside the output directory {out_dir}")
    refuse_existing_output(out_dir, force)


def refuse_existing_output(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not force:
        raise CheckpointError(f"{out_dir} exists; pass --force to replace it")


def copy_side_files(source_dir: Path, target_dir: Path) -> None:
    for name in SIDE_FILES:
        if (source_dir / name).exists():
            shutil.copy2(source_dir / name, target_dir / name)


def write_directory_atomically(out_dir: Path, write: Callable[[Path], None], force: bool) -> None:
    """Calls `write(staging)` on a fresh directory next to `out_dir`, then renames it to `out_dir`: a failure leaves
    nothing behind, and an existing `out_dir` is replaced only with `force` (and put back if the swap fails).

    `out_dir` gets the mode `mkdir` would give it (not mkdtemp's 0o700). `write` may check what it wrote and fail,
    so Transformers' progress bars (`save_pretrained`'s) are off while it runs: the error line comes first."""
    refuse_existing_output(out_dir, force)
    umask = os.umask(0)
    os.umask(umask)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as error:
        raise CheckpointError(f"cannot write next to {out_dir}: {error}") from None
    progress_bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        os.chmod(staging, 0o777 & ~umask)
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
        if progress_bars:
            transformers_logging.enable_progress_bar()
        shutil.rmtree(staging, ignore_errors=True)


def output_dtype(tensors: dict[str, torch.Tensor], dtype_name: str | None) -> torch.dtype:
    """`--dtype`, else the checkpoint's own (its embeddings'), float64 becoming float32 with a note."""
    if dtype_name:
        return DTYPES[dtype_name]
    dtype = tensors["model.embed_tokens.weight"].dtype
    if dtype == torch.float64:
        print("float64 checkpoint: writing float32 (pass --dtype to choose)", file=sys.stderr)
        return torch.float32
    return dtype
