"""scripts/convert_to_vllm.py: the exact tensor mapping, and every kind of bad input refused cleanly."""

import json
import subprocess
import sys

import convert_to_vllm
import pytest
import torch
from conftest import REPO_ROOT, randomize_, tiny_config
from safetensors.torch import load_file, save_file

from modeling import HybridForCausalLM


@pytest.fixture
def hf_dir(tmp_path):
    torch.manual_seed(0)
    model = randomize_(HybridForCausalLM(tiny_config()))
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    return tmp_path / "hf"


def run_converter(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO_ROOT / "scripts" / "convert_to_vllm.py"), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_conversion_maps_every_tensor(hf_dir, tmp_path):
    out = tmp_path / "vllm"
    assert convert_to_vllm.main([str(hf_dir), str(out), "--dtype", "bfloat16"]) == 0
    src = load_file(hf_dir / "model.safetensors")
    dst = load_file(out / "model.safetensors")
    config = tiny_config()
    bf16 = lambda t: t.to(torch.bfloat16)
    expected = {
        "model.embed_tokens.weight": bf16(src["model.embed_tokens.weight"]),
        "model.norm.weight": bf16(src["model.norm.weight"]),
        "lm_head.weight": bf16(src["lm_head.weight"]),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        s = p + "self_attn.ssm."
        expected.update(
            {
                p + "input_layernorm.weight": bf16(src[p + "input_layernorm.weight"]),
                p + "post_attention_layernorm.weight": bf16(src[p + "post_attention_layernorm.weight"]),
                p + "self_attn.qkv_proj.weight": bf16(
                    torch.cat([src[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
                ),
                p + "self_attn.o_proj.weight": bf16(src[p + "self_attn.o_proj.weight"]),
                p + "self_attn.in_proj.weight": bf16(src[s + "in_proj.weight"]),
                p + "self_attn.out_proj.weight": bf16(src[s + "out_proj.weight"]),
                p + "mlp.gate_up_proj.weight": bf16(
                    torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]])
                ),
                p + "mlp.down_proj.weight": bf16(src[p + "mlp.down_proj.weight"]),
                p + "self_attn.attn.ssm.conv1d_weight": bf16(src[s + "conv1d.weight"].squeeze(1)),
                p + "self_attn.attn.ssm.conv1d_bias": bf16(src[s + "conv1d.bias"]),
                p + "self_attn.attn.ssm.x_proj.weight": bf16(src[s + "x_proj.weight"]),
                p + "self_attn.attn.ssm.dt_proj.weight": bf16(src[s + "dt_proj.weight"]),
                p + "self_attn.attn.ssm.dt_proj.bias": bf16(src[s + "dt_proj.bias"]),
                # A = -exp(A_log), computed once, kept in fp32 like D.
                p + "self_attn.attn.ssm.A": -torch.exp(src[s + "A_log"].double()).float(),
                p + "self_attn.attn.ssm.D": src[s + "D"].float(),
            }
        )
    assert set(dst) == set(expected)
    for name, tensor in expected.items():
        assert dst[name].dtype == tensor.dtype, name
        torch.testing.assert_close(dst[name], tensor, rtol=1e-6, atol=0, msg=name)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["model_type"] == "hybrid" and config_json["architectures"] == ["HybridForCausalLM"]
    assert config_json["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").exists()


def test_tied_embeddings_write_no_lm_head(tmp_path):
    HybridForCausalLM(tiny_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "hf")
    assert convert_to_vllm.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def corrupt_tensors(hf_dir, edit):
    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def corrupt_config(hf_dir, **fields):
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


CORRUPTIONS = {
    "missing tensor": (
        lambda d: corrupt_tensors(d, lambda t: t.pop("model.layers.1.self_attn.ssm.A_log")),
        "missing tensor model.layers.1.self_attn.ssm.A_log",
    ),
    "wrong shape": (
        lambda d: corrupt_tensors(d, lambda t: t.update({"model.layers.0.self_attn.ssm.D": torch.ones(7)})),
        "model.layers.0.self_attn.ssm.D has shape (7,)",
    ),
    "unknown tensor": (
        lambda d: corrupt_tensors(d, lambda t: t.update({"model.extra.weight": torch.ones(2)})),
        "unknown tensor model.extra.weight",
    ),
    "integer tensor": (
        lambda d: corrupt_tensors(d, lambda t: t.update({"model.norm.weight": torch.ones(48, dtype=torch.int32)})),
        "model.norm.weight has dtype torch.int32",
    ),
    "nan": (
        lambda d: corrupt_tensors(
            d, lambda t: t["model.layers.2.mlp.up_proj.weight"].__setitem__((0, 0), float("nan"))
        ),
        "model.layers.2.mlp.up_proj.weight holds NaN",
    ),
    "wrong model_type": (lambda d: corrupt_config(d, model_type="llama"), "model_type is 'llama'"),
    "invalid config": (lambda d: corrupt_config(d, num_key_value_heads=3), "num_key_value_heads"),
    "unreadable weights": (lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file"), "cannot read"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "no config": (lambda d: (d / "config.json").unlink(), "config.json not found"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_input_is_refused_with_one_line_and_no_output(hf_dir, tmp_path, kind, capsys):
    corrupt, message = CORRUPTIONS[kind]
    corrupt(hf_dir)
    out = tmp_path / "out"
    assert convert_to_vllm.main([str(hf_dir), str(out)]) != 0
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and message in last_line, last_line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "a temporary directory was left behind"


def test_existing_output_needs_force(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_converter(hf_dir, out)
    assert result.returncode != 0 and "--force" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert run_converter(hf_dir, out, "--force").returncode == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
