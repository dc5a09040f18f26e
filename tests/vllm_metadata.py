"""vLLM metadata for tests, made by vLLM's own types and builders (not typed by hand): the common attention metadata
of a batch and SSM state metadata from a state builder (the hybrid's or Mamba-1's)."""

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec


def ssm_metadata_builder(builder_cls, state_shapes, layer_name="layer", device="cpu", max_graph_rows=8):
    """A state-metadata builder of `builder_cls` for Mamba-1-shaped fp32 states ((conv shape), (ssm shape)), with
    decode graphs of up to `max_graph_rows` rows on every platform (vLLM's defaults differ per device)."""
    config = VllmConfig()
    config.compilation_config.max_cudagraph_capture_size = max_graph_rows
    spec = MambaSpec(
        block_size=16,
        shapes=state_shapes,
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA1,
    )
    with set_current_vllm_config(config):
        return builder_cls(spec, [layer_name], config, torch.device(device))


def common_metadata(seq_lens, query_lens, is_prefilling, state_blocks, device="cpu") -> CommonAttentionMetadata:
    """vLLM's common metadata for a batch (decodes first); each request's block table holds its state block, one
    column as vLLM gives SSM groups without prefix caching."""
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_table = torch.tensor([[block] for block in state_blocks], dtype=torch.int32)
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
        is_prefilling=torch.tensor(is_prefilling, device=device),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )
