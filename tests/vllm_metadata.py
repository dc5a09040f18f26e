"""vLLM metadata for tests, made by vLLM's own types and builders (not typed by hand): the common attention metadata
of a batch (for an SSM state group, and its per-group copy for an attention group), SSM state metadata from a state
builder (the hybrid's, its Mamba-2 one, or Mamba-1's) and attention metadata from an attention builder (the
hybrid's Triton one)."""

import tempfile

import torch
from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec


def ssm_metadata_builder(builder_cls, state_shapes, layer_name="layer", device="cpu", max_graph_rows=8):
    """A state-metadata builder of `builder_cls` for fp32 states ((conv shape), (ssm shape)), with decode graphs of
    up to `max_graph_rows` rows on every platform (vLLM's defaults differ per device). The builders read neither the
    model's config nor the states' layout (Mamba-1's here, whatever the shapes)."""
    config = VllmConfig()
    config.compilation_config.max_cudagraph_capture_size = max_graph_rows
    spec = MambaSpec(
        block_size=16, shapes=state_shapes, dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA1,
    )  # fmt: skip
    with set_current_vllm_config(config):
        return builder_cls(spec, [layer_name], config, torch.device(device))


def attention_metadata_builder(
    builder_cls, hf_config, block_size=16, layer_name="layer", device="cpu", max_graph_rows=8
):
    """An attention-metadata builder of `builder_cls` for a sliding-window layer (fp32 KV, `block_size` tokens a
    block) of the hybrid model that `hf_config` (a `HybridConfig` naming its architecture) describes, decode graphs
    as in `ssm_metadata_builder`.

    vLLM's Triton builder reads the query and KV head counts and the head size from the `ModelConfig`
    (`model_vllm_config`). The builder itself runs no platform check, so on CPU too it is the one CUDA serves with."""
    config = model_vllm_config(hf_config, max_graph_rows)
    model_config = config.model_config
    spec = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=model_config.get_num_kv_heads(config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=torch.float32,
        sliding_window=hf_config.sliding_window,
    )
    with set_current_vllm_config(config):
        return builder_cls(spec, [layer_name], config, torch.device(device))


def model_vllm_config(hf_config, max_graph_rows=8) -> VllmConfig:
    """A vLLM config for the hybrid model `hf_config` describes (fp32, decode graphs of up to `max_graph_rows` rows),
    its `ModelConfig` made as `vllm serve` makes it, which vLLM does from a model directory only: `hf_config` is saved
    to a temporary one (config.json alone: no weights, no tokenizer) and read back, the architecture resolved through
    vLLM's registry once the plugin (installed with the project) is loaded. Prefix caching is off (with it vLLM puts
    the hybrid's state groups in its "align" mode), as the one-column state block tables here assume."""
    load_general_plugins()
    with tempfile.TemporaryDirectory() as model_dir:
        hf_config.save_pretrained(model_dir)
        return VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
            cache_config=CacheConfig(enable_prefix_caching=False),
            compilation_config=CompilationConfig(max_cudagraph_capture_size=max_graph_rows),  # capture sizes from it
        )


def common_metadata(seq_lens, query_lens, is_prefilling, state_blocks, device="cpu") -> CommonAttentionMetadata:
    """vLLM's common metadata for a batch (decodes first), as an SSM state group gets it: each request's block
    table holds its state block, one column as vLLM gives SSM groups without prefix caching. vLLM computes no slot
    mapping for state groups (their buffer is left as it was): a placeholder here. `attention_group_metadata` makes
    an attention group's."""
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_table = torch.tensor([[block] for block in state_blocks], dtype=torch.int32)
    # Each request's new tokens take the positions after its cached ones.
    positions = [position for seq, q in zip(seq_lens, query_lens) for position in range(seq - q, seq)]
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_reqs=len(seq_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(device),
        slot_mapping=torch.arange(sum(query_lens), device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        is_prefilling=torch.tensor(is_prefilling),  # on the host, as vLLM's model runner gives it
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )


def attention_group_metadata(common, block_table, block_size) -> CommonAttentionMetadata:
    """`common` for an attention KV-cache group of the same batch, as vLLM's model runner makes each group's: a
    shallow copy with the group's block table ([requests, blocks]) and its slot mapping, each new token's slot
    `block_table[i, position // block_size] * block_size + position % block_size` as vLLM's block table computes
    it."""
    block_table = block_table.to(device=common.block_table_tensor.device, dtype=torch.int32)
    query_lens = common.query_start_loc_cpu.diff().to(common.positions.device)
    requests = torch.repeat_interleave(torch.arange(common.num_reqs, device=common.positions.device), query_lens)
    blocks = block_table[requests, common.positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + common.positions % block_size
    return common.replace(block_table_tensor=block_table, slot_mapping=slot_mapping)
