"""Upcycle a Llama, Mistral or Qwen2 checkpoint into a hybrid: the same attention and MLP, a sliding window, and a
fresh SSM history branch in every layer.

    python scripts/upcycle.py SOURCE_DIR OUTPUT_DIR [--sliding-window W] [--full-attention-layers I,J,...]
        [--ssm-intermediate-size E] [--ssm-state-size N] [--dtype bfloat16|float16|float32] [--seed S] [--force]

Embeddings, norms, q/k/v/o, the MLP and lm_head are copied as they are (Qwen2's q/k/v biases become the config's
`qkv_bias`); RoPE parameters, `tie_word_embeddings` and the special tokens are carried; tokenizer and generation files
are copied. Every layer becomes a sliding-window layer (window: `--sliding-window`, else the source's own, as a
Mistral checkpoint has) except those named in `--full-attention-layers`. The SSM branch starts as `_init_weights`
starts it, with its output projection at zero: before any training the hybrid computes its source's function with
that window (a Llama source: the Mistral of the same weights). Distil the long-range part back with
`scripts/train.py --model OUTPUT_DIR --teacher SOURCE_DIR`.

Every source tensor is checked (present, expected shape, floating point, finite, nothing unknown), and so is every
tensor written. The output is written next to OUTPUT_DIR and renamed at the end; OUTPUT_DIR is never overwritten
without `--force`. `AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)` loads it after `import modeling`.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from configuration import HybridConfig
from configuration.configuration_hybrid import ATTENTION_MODEL_FIELDS, SSM_TYPES

from .checkpoint_io import (
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
from .modeling_hybrid import HybridForCausalLM, HybridRotaryEmbedding

SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def load_source_config(source_dir: Path) -> PreTrainedConfig:
    raw = read_config_json(source_dir)
    config_path = source_dir / "config.json"
    model_type = raw.get("model_type")
    if model_type not in SOURCES:
        architectures = raw.get("architectures") or [model_type]
        raise CheckpointError(
            f"{config_path}: {architectures[0]!r} (model_type {model_type!r}) cannot be upcycled; supported "
            f"sources: {', '.join(cls.__name__ for _, cls in SOURCES.values())}"
        )
    config_class, _ = SOURCES[model_type]
    try:
        return config_class.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{config_path}: {error}") from None


def hybrid_config_for(
    source: PreTrainedConfig,
    sliding_window: int | None,
    full_attention_layers: list[int],
    ssm_fields: dict | None = None,
) -> HybridConfig:
    """The HybridConfig whose attention and MLP are the source's, windowed, with the history branch `ssm_fields`
    describe (HybridConfig's `ssm_*` fields: its kind and sizes; the defaults for those not given)."""
    if getattr(source, "mlp_bias", False):
        raise CheckpointError("the source's MLP has biases (mlp_bias=true); the hybrid's MLP has none")
    window = sliding_window if sliding_window is not None else getattr(source, "sliding_window", None)
    if window is None:
        raise CheckpointError(
            f"the {source.model_type} source has no sliding window; pass --sliding-window W "
            "(the hybrid's attention sees the last W tokens)"
        )
    num_layers = source.num_hidden_layers
    for index in full_attention_layers:
        if not 0 <= index < num_layers:
            raise CheckpointError(f"--full-attention-layers: {index} is not a layer index in [0, {num_layers})")
    if len(set(full_attention_layers)) != len(full_attention_layers):
        raise CheckpointError(f"--full-attention-layers names a layer twice: {full_attention_layers}")
    fields = {name: getattr(source, name) for name in ATTENTION_MODEL_FIELDS}
    if fields["pad_token_id"] is not None and not 0 <= fields["pad_token_id"] < source.vocab_size:
        fields["pad_token_id"] = None  # e.g. Llama 2's -1, "no padding token": the hybrid's config says so with None
    fields["head_dim"] = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    fields["rope_parameters"] = dict(source.rope_parameters)
    # Llama's attention_bias covers q/k/v and o; Qwen2 always has q/k/v biases and no o bias.
    fields["attention_bias"] = bool(getattr(source, "attention_bias", False))
    fields["qkv_bias"] = source.model_type == "qwen2"
    fields["sliding_window"] = window
    fields["layer_types"] = [
        "full_attention" if i in full_attention_layers else "sliding_attention" for i in range(num_layers)
    ]
    fields.update(ssm_fields or {})
    try:
        return HybridConfig(**fields)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def upcycled_model(tensors: dict[str, torch.Tensor], config: HybridConfig, seed: int) -> HybridForCausalLM:
    """The hybrid holding the source's tensors, its SSM branches initialised by `_init_weights` (fp32, seeded).

    Built on the meta device so that a large source is not first initialised in full: only the SSM branches and the
    RoPE buffers are materialised, and the copied tensors are assigned as they are."""
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    model.model.rotary_emb = HybridRotaryEmbedding(config=config)
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    not_copied = sorted(name for name in set(result.missing_keys) - tied if ".self_attn.ssm." not in name)
    if not_copied or result.unexpected_keys:  # the check against the source's own shapes makes this unreachable
        raise CheckpointError(f"the source's tensors do not fit the hybrid: {not_copied or result.unexpected_keys}")
    torch.manual_seed(seed)
    for layer in model.model.layers:
        layer.self_attn.ssm.to_empty(device="cpu")
        layer.self_attn.ssm.apply(model._init_weights)
    model.tie_weights()
    return model


def upcycle(
    source_dir: Path,
    out_dir: Path,
    sliding_window: int | None = None,
    full_attention_layers: list[int] | None = None,
    ssm_fields: dict | None = None,
    dtype_name: str | None = None,
    seed: int = 0,
    force: bool = False,
) -> HybridConfig:
    refuse_output_dir(source_dir, out_dir, force)
    source = load_source_config(source_dir)
    config = hybrid_config_for(source, sliding_window, full_attention_layers or [], ssm_fields)
    _, source_class = SOURCES[source.model_type]
    tensors = load_tensors(source_dir)
    if source.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the source ties it to the embeddings when it loads
    check_tensors(tensors, state_dict_shapes(lambda: source_class(source), source.tie_word_embeddings), "the source")
    dtype = output_dtype(tensors, dtype_name)
    model = upcycled_model(tensors, config, seed).to(dtype)
    hybrid_shapes = state_dict_shapes(lambda: HybridForCausalLM(config), config.tie_word_embeddings)

    def write(staging: Path) -> None:
        model.config.architectures = ["HybridForCausalLM"]
        model.save_pretrained(staging)
        copy_side_files(source_dir, staging)
        check_tensors(load_tensors(staging), hybrid_shapes, "the written checkpoint")

    write_directory_atomically(out_dir, write, force)
    return config


def layer_indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


# The command line's branch options, named as the HybridConfig fields they set.
SSM_ARGUMENTS = ("ssm_type", "ssm_intermediate_size", "ssm_state_size", "ssm_head_dim", "ssm_n_groups")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="upcycle.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source_dir", type=Path, help="save_pretrained Llama, Mistral or Qwen2 checkpoint")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sliding-window", type=int, help="window W (default: the source's; required without one)")
    parser.add_argument(
        "--full-attention-layers", type=layer_indices, default=[], help="layers that keep full attention, e.g. 0,11"
    )
    parser.add_argument(
        "--ssm-type", choices=SSM_TYPES, help="the history branch: mamba1 (default) or mamba2 (docs/DESIGN.md)"
    )
    parser.add_argument("--ssm-intermediate-size", type=int, help="SSM channels E (default: hidden_size)")
    parser.add_argument("--ssm-state-size", type=int, help="SSM state size N (default: 16)")
    parser.add_argument("--ssm-head-dim", type=int, help="mamba2: channels per head (default: 64)")
    parser.add_argument("--ssm-n-groups", type=int, help="mamba2: groups of heads sharing B and C (default: 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: the source's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SSM branch's initialisation")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        config = upcycle(
            args.source_dir,
            args.out_dir,
            args.sliding_window,
            args.full_attention_layers,
            {name: value for name in SSM_ARGUMENTS if (value := getattr(args, name)) is not None},
            args.dtype,
            args.seed,
            args.force,
        )
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    print(
        f"wrote the hybrid to {args.out_dir}: window {config.sliding_window}, full-attention layers {full or 'none'}, "
        f"SSM {config.ssm_type} E={config.ssm_intermediate_size} N={config.ssm_state_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
