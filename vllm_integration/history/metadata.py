"""The state metadata every history branch is served with: Mamba-1's, with the hybrid's decode/prefill split.

Every request with one new token at the head of the batch is a decode, a request's first token flagged to start from
zero: vLLM may replay a batch of such rows from its full "uniform decode" CUDA graph (attention.py), and its Model
Runner V2 puts one-token prompts among the decodes. Padded rows of a replay carry vLLM's null block as slot and a
False flag: they read zeros and write only into the null block. What a branch reads of it (the decodes' and the
prefills' state slots, the prefills' `query_start_loc_p` and `has_initial_states_p`) does not depend on the branch's
state layout.
"""

from dataclasses import dataclass, replace

import torch
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.mamba1_attn import (
    Mamba1AttentionBackend,
    Mamba1AttentionMetadata,
    Mamba1AttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills


@dataclass
class HybridSSMMetadata(Mamba1AttentionMetadata):
    # [decode rows] bool (None in batches without decode rows): False marks a request's first token, which starts
    # from a zero state whatever its slot holds.
    has_initial_states_d: torch.Tensor | None = None


class HybridSSMMetadataBuilder(Mamba1AttentionMetadataBuilder):
    """Mamba-1's metadata, except that every request with one new token at the head of the batch is a decode row,
    a request's first token (a one-token prompt) included, flagged in `has_initial_states_d`.

    Why: vLLM picks the full "uniform decode" CUDA graph from the batch's shape alone. Mamba-1's builder keeps a
    first token a prefill and then leaves the graph's decode buffers as the last decode batch wrote them, so the
    replayed decode would continue that request from a stale slot. Here such a batch is all decodes, its slots go
    into the persistent decode buffer as for any decode batch, and the flags into a persistent buffer of their own,
    which a captured graph reads on every replay. In mixed batches the same split keeps the decodes on the fused
    decode path: vLLM's V1 runner puts new prompts last, but Model Runner V2 orders requests by query length only,
    and Mamba-1's split would send every decode after a one-token prompt through the prefill kernels."""

    metadata_cls = HybridSSMMetadata
    # Not Mamba's UNIFORM_BATCH: no speculative decoding here, the decode kernels take one token per request.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.has_initial_states_d = torch.empty(self.decode_cudagraph_max_bs, dtype=torch.bool, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False, **kwargs
    ) -> HybridSSMMetadata:
        # The requests with at most one new token at the head of the batch (CUDA-graph padding rows have none),
        # whether vLLM calls them prefilling or not.
        num_decodes, *_ = split_decodes_and_prefills(common_attn_metadata)
        if num_decodes == 0:
            return super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        is_prefilling = common_attn_metadata.is_prefilling.clone()
        is_prefilling[:num_decodes] = False  # Mamba-1's split then cuts at the first longer query
        decodes_first = common_attn_metadata.replace(is_prefilling=is_prefilling)
        metadata = super().build(common_prefix_len, decodes_first, fast_build, **kwargs)
        seq_lens = common_attn_metadata.seq_lens[: metadata.num_decodes]  # CUDA-graph padding rows included
        return replace(metadata, has_initial_states_d=self._own_flags(seq_lens > 1))

    def update_block_table(
        self, metadata: HybridSSMMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> HybridSSMMetadata:
        """vLLM builds the metadata once for all SSM groups of one spec and hands it to the other groups' builders
        here: each group's captured graph reads its own builder's buffers, the flags' included."""
        metadata = super().update_block_table(metadata, blk_table, slot_mapping)
        if metadata.has_initial_states_d is None:
            return metadata
        return replace(metadata, has_initial_states_d=self._own_flags(metadata.has_initial_states_d))

    def _own_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """`flags` in this builder's persistent buffer (what its captured decode graphs read), when they fit."""
        rows = flags.shape[0]
        if rows > self.decode_cudagraph_max_bs:  # never replayed from a graph
            return flags
        return self.has_initial_states_d[:rows].copy_(flags)


class HybridSSMBackend(Mamba1AttentionBackend):
    """Mamba-1's state backend (same name, layout and kernels' metadata) with the hybrid's metadata builder."""

    @staticmethod
    def get_builder_cls() -> type[HybridSSMMetadataBuilder]:
        return HybridSSMMetadataBuilder


def token_split(metadata) -> tuple[slice, slice]:
    """(decode tokens, prefill tokens) of a packed batch: vLLM orders decodes (one new token) first. Rows past both
    are CUDA-graph padding, left unwritten (every later op works row by row)."""
    num_decode_tokens = metadata.num_decode_tokens
    return slice(0, num_decode_tokens), slice(num_decode_tokens, num_decode_tokens + metadata.num_prefill_tokens)
