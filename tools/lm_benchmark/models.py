"""The models compared, of the same shapes: the hybrid, `swa` (the hybrid without its SSM branch), `swa-matched` (`swa`
with its MLP widened to the hybrid's parameter count: what the branch's parameters would buy as plain width), `full`
(Llama), and those made from a trained `full` (upcycled, then distilled)."""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from configuration import HybridConfig

from modeling.checkpoint_io import load_tensors
from modeling.modeling_hybrid import HybridForCausalLM
from modeling.training import is_ssm_parameter, prepare_trainable
from modeling.upcycling import upcycle
from .tokens import TokenizedCorpus

MODELS = ("hybrid", "swa", "swa-matched", "full", "upcycled", "distilled", "distilled-swa")
FROM_TEACHER = ("upcycled", "distilled", "distilled-swa")  # built from a trained `full`


@dataclass(frozen=True)
class Shape:
    """The shapes shared by the three models, and the training sequence."""

    vocab_size: int = 16384
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    head_dim: int = 64
    window: int = 256  # W
    context: int = 4096  # T: 16 W, so that [4W, 16W) is inside a training sequence
    batch_size: int = 8


# What `--shape` picks. `small`: a quarter of the parameters outside the embeddings and half the layers (the hybrid's
# step is host-bound, paced by its layers), so that one device call trains several times more tokens.
SHAPES = {
    "base": Shape(),
    "small": Shape(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8),
}
SMOKE_SHAPE = Shape(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    window=16,
    context=128,
    batch_size=4,
)


def parameter_matched_intermediate_size(hybrid: HybridConfig) -> int:
    """The MLP width at which the model without the SSM branch has the hybrid's parameters: the branch's parameters
    spread over the MLPs' three matrices, to a multiple of 64 (counted on the meta device)."""
    without_branch = HybridConfig(**{**hybrid.to_dict(), "use_ssm_branch": False, "ssm_branch_norm": False})
    with torch.device("meta"):
        extra = HybridForCausalLM(hybrid).num_parameters() - HybridForCausalLM(without_branch).num_parameters()
    per_column = 3 * hybrid.hidden_size * hybrid.num_hidden_layers  # gate, up and down: one column of each per layer
    return hybrid.intermediate_size + 64 * round(extra / per_column / 64)


def shape_fields(shape: Shape) -> dict:
    """The `HybridConfig` fields of every model of a run of this shape but the tokenizer's (vocabulary and ids) and
    the window (the full-attention model has none)."""
    return dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4 * shape.context,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )


def build_model(
    kind: str, shape: Shape, tokenizer, attn_implementation: str, seed: int, overrides: dict | None = None
) -> torch.nn.Module:
    """A freshly initialised `kind` model (seeded: the same initial weights for the same shapes), on the GPU if any.
    `overrides`: `HybridConfig` fields that the hybrids (and the baselines' configs, where they apply) take instead of
    the defaults, e.g. the SSM's step-size range."""
    torch.manual_seed(seed)
    common = dict(
        shape_fields(shape),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "full":
        hybrid = HybridConfig(**common, sliding_window=shape.window)
        model = LlamaForCausalLM(hybrid.attention_only_config(full_attention=True))
    else:
        common.update(sliding_window=shape.window, **(overrides or {}))
        if kind == "swa-matched":
            common["intermediate_size"] = parameter_matched_intermediate_size(HybridConfig(**common))
        model = HybridForCausalLM(HybridConfig(**common, use_ssm_branch=kind == "hybrid"))
    return placed(model, attn_implementation)


def placed(model: torch.nn.Module, attn_implementation: str) -> torch.nn.Module:
    """`model` with the attention implementation it trains with, on the GPU if any: where every benchmark model runs
    (built, loaded or made from the teacher)."""
    model.set_attn_implementation(attn_implementation)
    return model.cuda() if torch.cuda.is_available() else model


def load_trained(kind: str, path: Path, attn_implementation: str) -> torch.nn.Module:
    """A `kind` model trained from scratch and saved by `--stage train`, as `build_model` places it."""
    model_class = LlamaForCausalLM if kind == "full" else HybridForCausalLM
    return placed(model_class.from_pretrained(path, dtype=torch.float32), attn_implementation)


def teacher_dir(args) -> Path:
    return args.teacher or args.output_dir / "full" / "checkpoint"


@functools.cache
def upcycled_checkpoint(teacher: Path, output_dir: Path, window: int) -> Path:
    """The teacher upcycled with the window (`modeling.upcycling.upcycle`, fp32), once per run: `full`, which writes
    the teacher, runs before every model made from it (`cli.parse_args` sees to that)."""
    upcycled_dir = output_dir / "upcycled" / "checkpoint"
    upcycle(teacher, upcycled_dir, sliding_window=window, dtype_name="float32", force=True)
    return upcycled_dir


def build_from_teacher(kind: str, shape: Shape, args) -> torch.nn.Module:
    """The upcycled `full` checkpoint with its SSM branch (`upcycled`, `distilled`) or without (`distilled-swa`), on
    the GPU if any."""
    upcycled_dir = upcycled_checkpoint(teacher_dir(args), args.output_dir, shape.window)
    if kind == "distilled-swa":  # the same tensors less the branch, strictly
        model = HybridForCausalLM(HybridConfig.from_pretrained(upcycled_dir, use_ssm_branch=False))
        tensors = load_tensors(upcycled_dir)
        model.load_state_dict({name: t for name, t in tensors.items() if not is_ssm_parameter(name)})
    else:
        model = HybridForCausalLM.from_pretrained(upcycled_dir)
    return placed(model, args.attn)


def load_teacher(args) -> torch.nn.Module:
    """The distillation teacher in bf16 on the GPU (fp32 on CPU), with SDPA: it only runs forward."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir(args), dtype=dtype, attn_implementation="sdpa")
    return teacher.cuda() if torch.cuda.is_available() else teacher


def model_to_train(kind: str, data: TokenizedCorpus, shape: Shape, args) -> tuple[torch.nn.Module, dict]:
    """The model of `kind` before training, and what `train_model` needs beside it (the teacher, for distillation)."""
    if kind not in FROM_TEACHER:
        return build_model(kind, shape, data.tokenizer, args.attn, args.seed, args.config_overrides), {}
    model = build_from_teacher(kind, shape, args)
    if kind == "upcycled":
        return model, {}
    return prepare_trainable(model, args.distill_mode), {"teacher": load_teacher(args)}
