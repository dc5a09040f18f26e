"""`HybridSSMMetadataBuilder` on vLLM's own metadata types (CPU): which rows are decodes, which start from zero,
and which buffers a captured decode graph would read."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm_metadata import common_metadata, ssm_metadata_builder

from vllm_integration.history.metadata import HybridSSMMetadataBuilder


@pytest.fixture(scope="module")
def builders():
    """Two builders of one state spec, as vLLM makes for two SSM KV-cache groups."""
    return [ssm_metadata_builder(HybridSSMMetadataBuilder, ((24, 3), (24, 8)), f"group{i}") for i in range(2)]


def test_one_token_steps_are_all_decodes_first_tokens_flagged(builders):
    """Two continuing decodes, a one-token prompt (vLLM still calls it prefilling) and a CUDA-graph padding row
    (seq_len 0, the null block): all four are decode rows; only the continuing ones read their slot."""
    first, second = builders
    common = common_metadata([21, 1, 5, 0], [1, 1, 1, 0], [False, True, False, False], [1, 2, 3, 0])
    metadata = first.build(0, common)
    assert (metadata.num_decodes, metadata.num_prefills) == (4, 0)
    assert metadata.state_indices_tensor_d[:, 0].tolist() == [1, 2, 3, 0]
    assert metadata.has_initial_states_d.tolist() == [True, False, True, False]
    # A captured decode graph of this group reads the builder's persistent flag buffer ...
    assert metadata.has_initial_states_d.data_ptr() == first.has_initial_states_d.data_ptr()
    # ... and another group handed the same metadata gets its own slots and its own buffer, same flags.
    other_blocks = torch.tensor([[4], [5], [6], [0]], dtype=torch.int32)
    other = second.update_block_table(metadata, other_blocks, common.slot_mapping)
    assert other.state_indices_tensor_d[:, 0].tolist() == [4, 5, 6, 0]
    assert other.has_initial_states_d.tolist() == [True, False, True, False]
    assert other.has_initial_states_d.data_ptr() == second.has_initial_states_d.data_ptr()


# (seq_lens, query_lens, is_prefilling, state blocks) and what the builder makes of them: decode flags and slots,
# prefill flags, slots and token offsets.
MIXED_BATCHES = {
    # Model Runner V2: one-token rows first in any order (a new one-token prompt between two decodes).
    "v2-order": (
        ([21, 1, 5, 30], [1, 1, 1, 30], [False, True, False, True], [1, 2, 3, 4]),
        ([True, False, True], [1, 2, 3], [False], [4], [0, 30]),
    ),
    # The V1 runner: new prompts last (a 30-token one before a one-token one).
    "v1-order": (
        ([21, 5, 30, 1], [1, 1, 30, 1], [False, False, True, True], [1, 3, 4, 2]),
        ([True, True], [1, 3], [False, False], [4, 2], [0, 30, 31]),
    ),
}


@pytest.mark.parametrize("rows, expected", MIXED_BATCHES.values(), ids=MIXED_BATCHES.keys())
def test_mixed_batches_split_at_the_first_longer_query(builders, rows, expected):
    """A batch with a longer prompt (never replayed from a full graph): every one-token row before it is a decode,
    a new one-token prompt among them flagged to start from zero; from the first longer query on, Mamba-1's prefill
    rows (each starting from zero or continuing its slot: has_initial_states_p)."""
    flags_d, slots_d, flags_p, slots_p, query_start_loc_p = expected
    metadata = builders[0].build(0, common_metadata(*rows))
    assert (metadata.num_decodes, metadata.num_prefills) == (len(flags_d), len(flags_p))
    assert metadata.has_initial_states_d.tolist() == flags_d
    assert metadata.state_indices_tensor_d[:, 0].tolist() == slots_d
    assert metadata.has_initial_states_p.tolist() == flags_p
    assert metadata.state_indices_tensor_p.tolist() == slots_p
    assert metadata.query_start_loc_p.tolist() == query_start_loc_p


def test_a_batch_led_by_a_longer_query_has_no_decode_rows(builders):
    """vLLM orders decodes first, so a longer query at the head means no decodes: all prefills, no flags."""
    metadata = builders[0].build(0, common_metadata([30, 1], [30, 1], [True, True], [4, 2]))
    assert (metadata.num_decodes, metadata.num_prefills) == (0, 2)
    assert metadata.has_initial_states_d is None
    assert metadata.has_initial_states_p.tolist() == [False, False]


def test_one_token_rows_without_a_longer_query_are_all_decodes(builders):
    """A batch whose recorded longest query exceeds its rows' (vLLM computes it exactly today): every row still
    counts as a one-token row, so the batch stays all decodes rather than falling back to Mamba-1's split."""
    common = common_metadata([21, 1, 5], [1, 1, 1], [False, True, False], [1, 2, 3])
    metadata = builders[0].build(0, common.replace(max_query_len=2))
    assert (metadata.num_decodes, metadata.num_prefills) == (3, 0)
    assert metadata.has_initial_states_d.tolist() == [True, False, True]
    metadata = builders[0].build(0, common_metadata([21, 30], [1, 30], [False, True], [1, 2]))
    assert (metadata.num_decodes, metadata.num_prefills) == (1, 1)
