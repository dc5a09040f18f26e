"""The upcycler (modeling/upcycling.py, CLI scripts/upcycle.py): Llama, Mistral and Qwen2 checkpoints become hybrids
that compute their source's function with the window (checked against Transformers' own classes), and every kind of
bad input is refused cleanly."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from modeling import HybridForCausalLM, upcycling
from modeling.recall_task import RecallTask

VOCAB = 101
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=50000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random norms and biases too (both start at constants), so that a dropped or misplaced one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


def save_source(model, path, **save_kwargs):
    model.save_pretrained(path, **save_kwargs)
    return path


def upcycled(source_dir, out_dir, *args) -> HybridForCausalLM:
    assert upcycling.main([str(source_dir), str(out_dir), *map(str, args)]) == 0
    return AutoModelForCausalLM.from_pretrained(out_dir).eval()


def tokens(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_same_logits(model, reference, input_ids, attention_mask=None):
    expected = reference(input_ids, attention_mask=attention_mask).logits
    actual = model(input_ids, attention_mask=attention_mask).logits
    mask = attention_mask.bool() if attention_mask is not None else torch.ones(input_ids.shape, dtype=torch.bool)
    torch.testing.assert_close(actual[mask], expected[mask], atol=1e-4, rtol=0)


def test_a_mistral_source_keeps_its_window_and_its_function(tmp_path):
    torch.manual_seed(0)
    source = randomized(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)))
    hybrid = upcycled(save_source(source, tmp_path / "mistral"), tmp_path / "hybrid")

    assert isinstance(hybrid, HybridForCausalLM)
    assert hybrid.config.sliding_window == 5 and set(hybrid.config.layer_types) == {"sliding_attention"}
    assert_same_logits(hybrid, source, tokens(23))  # 23 > 4 W: the window decides every late position
    left_padded = torch.ones(2, 23, dtype=torch.long)
    left_padded[1, :7] = 0
    assert_same_logits(hybrid, source, tokens(23, seed=1), left_padded)

    prompt = tokens(9, batch=1, seed=2)
    generate = dict(max_new_tokens=14, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(
        hybrid.generate(prompt, **generate), source.generate(prompt, **generate), rtol=0, atol=0
    )


def test_a_llama_source_with_a_window_is_the_mistral_of_its_weights(tmp_path):
    torch.manual_seed(1)
    llama = randomized(LlamaForCausalLM(LlamaConfig(**DIMS, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)))
    mistral = MistralForCausalLM(
        MistralConfig(**DIMS, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True, sliding_window=6)
    )
    mistral.load_state_dict(llama.state_dict())
    hybrid = upcycled(save_source(llama, tmp_path / "llama"), tmp_path / "hybrid", "--sliding-window", 6)

    assert hybrid.config.tie_word_embeddings and hybrid.lm_head.weight is hybrid.model.embed_tokens.weight
    assert hybrid.config.rope_parameters["rope_type"] == "llama3"
    assert_same_logits(hybrid, mistral.eval(), tokens(40))
    with torch.no_grad():  # the window is what differs from the Llama: the test can tell the two apart
        assert (hybrid(tokens(40)).logits - llama(tokens(40)).logits).abs().max() > 1e-2


@pytest.mark.parametrize(
    "source_class, config_class, extra",
    [(Qwen2ForCausalLM, Qwen2Config, {}), (LlamaForCausalLM, LlamaConfig, {"attention_bias": True})],
    ids=["qwen2-qkv-bias", "llama-attention-bias"],
)
def test_biases_are_carried_with_a_window_wider_than_the_input(tmp_path, source_class, config_class, extra):
    torch.manual_seed(2)
    source = randomized(source_class(config_class(**DIMS, **extra)))
    # Sharded, as large checkpoints are written.
    source_dir = save_source(source, tmp_path / "source", max_shard_size="40KB")
    assert (source_dir / "model.safetensors.index.json").exists()
    hybrid = upcycled(source_dir, tmp_path / "hybrid", "--sliding-window", 64)

    layer = hybrid.model.layers[0].self_attn
    assert layer.q_proj.bias is not None and layer.v_proj.bias is not None
    assert (layer.o_proj.bias is not None) == (source_class is LlamaForCausalLM)
    assert_same_logits(hybrid, source, tokens(30))


def test_full_attention_layers_keep_full_attention(tmp_path):
    torch.manual_seed(3)
    llama = randomized(LlamaForCausalLM(LlamaConfig(**DIMS)))
    hybrid = upcycled(
        save_source(llama, tmp_path / "llama"), tmp_path / "hybrid", "--sliding-window", 4, "--full-attention-layers",
        "0,1,2",
    )  # fmt: skip
    assert hybrid.config.layer_types == ["full_attention"] * 3
    assert_same_logits(hybrid, llama, tokens(20))

    partly = upcycled(tmp_path / "llama", tmp_path / "partly", "--sliding-window", 4, "--full-attention-layers", "1")
    assert partly.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_a_padding_id_outside_the_vocabulary_means_none(tmp_path):
    torch.manual_seed(9)
    llama = randomized(LlamaForCausalLM(LlamaConfig(**{**DIMS, "pad_token_id": None})))
    source_dir = save_source(llama, tmp_path / "llama")
    config = json.loads((source_dir / "config.json").read_text())
    (source_dir / "config.json").write_text(json.dumps({**config, "pad_token_id": -1}))  # as Llama 2's on the Hub
    hybrid = upcycled(source_dir, tmp_path / "hybrid", "--sliding-window", 64)
    assert hybrid.config.pad_token_id is None
    assert_same_logits(hybrid, llama, tokens(20))


def test_the_ssm_branch_is_live_and_its_options_are_applied(tmp_path):
    torch.manual_seed(4)
    source = randomized(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)))
    hybrid = upcycled(
        save_source(source, tmp_path / "mistral"), tmp_path / "hybrid", "--ssm-intermediate-size", 48,
        "--ssm-state-size", 8,
    )  # fmt: skip
    ssm = hybrid.model.layers[0].self_attn.ssm
    assert ssm.A_log.shape == (48, 8) and torch.equal(ssm.out_proj.weight, torch.zeros_like(ssm.out_proj.weight))
    # The branch starts as _init_weights starts it: A = -(1..N), the last quarter of the channels 1e4 times slower
    # (the default ssm_slow_channel_fraction), D = 1, softplus(dt bias) in [dt_min, dt_max].
    s4d_real = torch.arange(1.0, 9.0).expand(48, 8)
    torch.testing.assert_close(torch.exp(ssm.A_log), torch.cat([s4d_real[:36], s4d_real[36:] * 1e-4]))
    torch.testing.assert_close(ssm.D, torch.ones(48))
    dt = torch.nn.functional.softplus(ssm.dt_proj.bias)
    assert dt.min() >= hybrid.config.ssm_dt_min * 0.999 and dt.max() <= hybrid.config.ssm_dt_max * 1.001

    ids = tokens(20)
    with torch.no_grad():
        before = hybrid(ids).logits
    ssm_params = [p for n, p in hybrid.named_parameters() if ".ssm." in n]
    optimizer = torch.optim.SGD(ssm_params, lr=1e-2)
    hybrid.train()
    hybrid(ids, labels=ids).loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = hybrid.eval()(ids).logits
    assert (after - before).abs().max() > 1e-4


def test_a_mamba2_branch_upcycles_exactly_and_trains(tmp_path):
    torch.manual_seed(5)
    source = randomized(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)))
    hybrid = upcycled(
        save_source(source, tmp_path / "mistral"), tmp_path / "hybrid", "--ssm-type", "mamba2",
        "--ssm-intermediate-size", 48, "--ssm-head-dim", 12, "--ssm-n-groups", 2, "--ssm-state-size", 8,
    )  # fmt: skip
    config = hybrid.config
    assert (config.ssm_type, config.ssm_num_heads, config.ssm_n_groups, config.ssm_state_size) == ("mamba2", 4, 2, 8)
    ssm = hybrid.model.layers[0].self_attn.ssm
    assert ssm.in_proj.weight.shape[0] == 48 + (48 + 2 * 2 * 8) + 4
    assert_same_logits(hybrid, source, tokens(23))  # W_out = 0: the source's function with its window
    hybrid.train()
    hybrid(tokens(20), labels=tokens(20)).loss.backward()
    assert ssm.out_proj.weight.grad.abs().sum() > 0


def test_tokenizer_generation_config_and_dtype_are_carried(tmp_path):
    tokenizer = RecallTask().build_tokenizer()
    torch.manual_seed(5)
    source = randomized(MistralForCausalLM(MistralConfig(**{**DIMS, "vocab_size": len(tokenizer)}, sliding_window=5)))
    source.generation_config.max_new_tokens = 7
    source_dir = save_source(source.to(torch.bfloat16), tmp_path / "mistral")
    tokenizer.save_pretrained(source_dir)

    assert upcycling.main([str(source_dir), str(tmp_path / "bf16")]) == 0
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert AutoTokenizer.from_pretrained(tmp_path / "bf16")("a b").input_ids == tokenizer("a b").input_ids
    assert json.loads((tmp_path / "bf16" / "generation_config.json").read_text())["max_new_tokens"] == 7

    assert upcycling.main([str(source_dir), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert {t.dtype for t in load_file(tmp_path / "fp32" / "model.safetensors").values()} == {torch.float32}


def test_the_script_runs_standalone(tmp_path):
    torch.manual_seed(6)
    source_dir = save_source(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)), tmp_path / "mistral")
    command = [sys.executable, str(REPO_ROOT / "scripts" / "upcycle.py"), str(source_dir), str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "window 5" in result.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "hybrid"


def write_source(tmp_path, kind: str):
    """A source directory with one defect, and the message the upcycler must give."""
    torch.manual_seed(7)
    source_dir = tmp_path / "source"
    if kind == "unsupported architecture":
        GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).save_pretrained(source_dir)
        return source_dir, [], "'GPT2LMHeadModel' (model_type 'gpt2') cannot be upcycled"
    if kind == "mlp bias":
        LlamaForCausalLM(LlamaConfig(**DIMS, mlp_bias=True)).save_pretrained(source_dir)
        return source_dir, ["--sliding-window", "4"], "mlp_bias"
    LlamaForCausalLM(LlamaConfig(**DIMS)).save_pretrained(source_dir)
    if kind == "no window":
        return source_dir, [], "has no sliding window; pass --sliding-window"
    if kind == "window of one":
        return source_dir, ["--sliding-window", "1"], "sliding_window must be an integer >= 2"
    if kind == "layer out of range":
        return source_dir, ["--sliding-window", "4", "--full-attention-layers", "3"], "3 is not a layer index"
    if kind == "bad ssm size":
        return source_dir, ["--sliding-window", "4", "--ssm-state-size", "0"], "ssm_state_size must be a positive"
    if kind == "no config":
        (source_dir / "config.json").unlink()
        return source_dir, ["--sliding-window", "4"], "config.json not found"
    tensors = load_file(source_dir / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if kind == "wrong shape":
        tensors[name] = tensors[name][:-1]
        expected = f"{name} has shape (31, 64), expected (32, 64) in the source"
    elif kind == "nan":
        tensors[name][0, 0] = float("nan")
        expected = f"{name} holds NaN"
    elif kind == "missing tensor":
        del tensors[name]
        expected = f"missing tensor {name} in the source"
    elif kind == "unknown tensor":
        tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
        expected = "unknown tensor model.layers.1.self_attn.q_norm.weight in the source"
    save_file(tensors, source_dir / "model.safetensors", metadata={"format": "pt"})
    return source_dir, ["--sliding-window", "4"], expected


@pytest.mark.parametrize(
    "kind",
    [
        "unsupported architecture",
        "mlp bias",
        "no window",
        "window of one",
        "layer out of range",
        "bad ssm size",
        "no config",
        "wrong shape",
        "nan",
        "missing tensor",
        "unknown tensor",
    ],
)
def test_bad_input_is_refused_with_one_line_and_no_output(tmp_path, capsys, kind):
    source_dir, args, expected = write_source(tmp_path, kind)
    out_dir = tmp_path / "out" / "hybrid"
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert upcycling.main([str(source_dir), str(out_dir), *args]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and expected in error, error
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written, no staging directory left


def test_an_existing_output_needs_force(tmp_path, capsys):
    torch.manual_seed(8)
    source_dir = save_source(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)), tmp_path / "mistral")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    assert upcycling.main([str(source_dir), str(out_dir)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out_dir / "keep.txt").read_text() == "mine"

    assert upcycling.main([str(source_dir), str(out_dir), "--force"]) == 0
    assert not (out_dir / "keep.txt").exists() and (out_dir / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mistral", "out"]


@pytest.mark.parametrize("where", ["the source", "inside the source", "above the source"])
def test_an_output_overlapping_the_source_is_refused_even_with_force(tmp_path, capsys, where):
    torch.manual_seed(10)
    source_dir = save_source(MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)), tmp_path / "top" / "src")
    out_dir = {"the source": source_dir, "inside the source": source_dir / "out", "above the source": tmp_path / "top"}
    before = sorted(p.name for p in source_dir.iterdir())
    capsys.readouterr()
    assert upcycling.main([str(source_dir), str(out_dir[where]), "--force"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert sorted(p.name for p in source_dir.iterdir()) == before


def test_a_float64_source_is_written_as_float32(tmp_path, capsys):
    torch.manual_seed(11)
    source = MistralForCausalLM(MistralConfig(**DIMS, sliding_window=5)).double()
    assert upcycling.main([str(save_source(source, tmp_path / "src")), str(tmp_path / "out")]) == 0
    assert "float64 checkpoint: writing float32" in capsys.readouterr().err
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.float32}
