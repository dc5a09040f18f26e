"""The vLLM converter (vllm_integration/convert.py, CLI scripts/convert_to_vllm.py): the exact tensor mapping, and
every kind of bad input refused cleanly."""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, randomize_, tiny_config
from safetensors.torch import load_file, save_file

from modeling import HybridForCausalLM
from vllm_integration import convert


SSM_CAST_TENSORS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "out_proj.weight",
)


@pytest.fixture
def hf_dir(tmp_path):
    torch.manual_seed(0)
    model = randomize_(HybridForCausalLM(tiny_config()))
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    return tmp_path / "hf"


def run_converter(*args, umask: int = -1) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO_ROOT / "scripts" / "convert_to_vllm.py"), *map(str, args)]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, umask=umask)


def assert_refused(returncode: int, stderr: str, message: str) -> None:
    """Exit code 2 and one `error:` line naming the problem: the first stderr line and the only one."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr


def test_conversion_maps_every_tensor(hf_dir, tmp_path):
    out = tmp_path / "vllm"
    assert convert.main([str(hf_dir), str(out), "--dtype", "bfloat16"]) == 0
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
                # The SSM tensors keep their names and values (vLLM's loader maps them), A_log and D in fp32.
                **{s + name: bf16(src[s + name]) for name in SSM_CAST_TENSORS},
                s + "A_log": src[s + "A_log"].float(),
                s + "D": src[s + "D"].float(),
                p + "mlp.gate_up_proj.weight": bf16(
                    torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]])
                ),
                p + "mlp.down_proj.weight": bf16(src[p + "mlp.down_proj.weight"]),
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
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
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


def shard(hf_dir, edit_shards=lambda shards: None, edit_index=lambda index: None):
    """Splits `model.safetensors` into two shards and their index (as `save_pretrained(max_shard_size=...)` writes
    them), after `edit_shards({file: tensors})` and `edit_index(index)`."""
    tensors = load_file(hf_dir / "model.safetensors")
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    shards = {file: {name: tensors[name] for name in half} for file, half in zip(files, halves)}
    index = {"metadata": {}, "weight_map": {name: file for file, half in zip(files, halves) for name in half}}
    edit_shards(shards)
    edit_index(index)
    (hf_dir / "model.safetensors").unlink()
    for file, shard_tensors in shards.items():
        save_file(shard_tensors, hf_dir / file, metadata={"format": "pt"})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))


FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"  # in the first shard and in the second
A_LOG = "model.layers.0.self_attn.ssm.A_log"


def move_norm_to_first_shard(shards):
    shards[FIRST][NORM] = shards[SECOND].pop(NORM)


# kind -> (corruption of the checkpoint, what the error line names, extra converter arguments)
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
        lambda d: corrupt_tensors(d, lambda t: t.update({NORM: torch.ones(48, dtype=torch.int32)})),
        "model.norm.weight has dtype torch.int32",
    ),
    "float8 tensor": (
        lambda d: corrupt_tensors(d, lambda t: t.update({NORM: t[NORM].to(torch.float8_e4m3fn)})),
        "model.norm.weight has dtype torch.float8_e4m3fn",
    ),
    "nan": (
        lambda d: corrupt_tensors(
            d, lambda t: t["model.layers.2.mlp.up_proj.weight"].__setitem__((0, 0), float("nan"))
        ),
        "model.layers.2.mlp.up_proj.weight holds NaN",
    ),
    "A overflows": (
        lambda d: corrupt_tensors(d, lambda t: t[A_LOG].__setitem__((0, 0), 100.0)),
        "model.layers.0.self_attn.ssm.A_log: A = -exp(A_log) overflows float32",
    ),
    "float16 overflow": (
        lambda d: corrupt_tensors(d, lambda t: t[NORM].__setitem__(0, 1e6)),
        "model.norm.weight overflows float16",
        ("--dtype", "float16"),
    ),
    "wrong model_type": (lambda d: corrupt_config(d, model_type="llama"), "model_type is 'llama'"),
    "invalid config": (lambda d: corrupt_config(d, num_key_value_heads=3), "num_key_value_heads"),
    "config is a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "does not hold a JSON object"),
    "unknown rope_type": (
        lambda d: corrupt_config(d, rope_parameters={"rope_type": "bogus", "rope_theta": 10000.0}),
        "bogus",
    ),
    "rope_parameters a string": (lambda d: corrupt_config(d, rope_parameters="llama3"), "config.json: "),
    "rope_parameters incomplete": (
        lambda d: corrupt_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0}),
        "config.json",
    ),
    "unreadable weights": (lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file"), "cannot read"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors"),
    "no config": (lambda d: (d / "config.json").unlink(), "config.json not found"),
    "index is a list": (
        lambda d: shard(d) or (d / "model.safetensors.index.json").write_text("[]"),
        "model.safetensors.index.json does not hold a JSON object",
    ),
    "weight_map is a list": (
        lambda d: shard(d, edit_index=lambda index: index.update(weight_map=[FIRST, SECOND])),
        "weight_map is not a JSON object",
    ),
    "weight_map value not a string": (
        lambda d: shard(d, edit_index=lambda index: index["weight_map"].update({NORM: 2})),
        f"weight_map gives {NORM} the file 2",
    ),
    "tensor in two shards": (
        lambda d: shard(d, edit_shards=lambda shards: shards[FIRST].update({NORM: shards[SECOND][NORM] + 1})),
        f"{NORM} is in both {FIRST} and {SECOND}",
    ),
    "tensor in another shard than the index says": (
        lambda d: shard(d, edit_shards=move_norm_to_first_shard),
        f"{FIRST} holds {NORM}, which model.safetensors.index.json puts in {SECOND}",
    ),
    "shard tensor not in the index": (
        lambda d: shard(d, edit_index=lambda index: index["weight_map"].pop(EMBED)),
        f"{FIRST} holds {EMBED}, which model.safetensors.index.json does not list",
    ),
    "index tensor in no shard": (
        lambda d: shard(d, edit_index=lambda index: index["weight_map"].update({"model.extra.weight": FIRST})),
        f"model.safetensors.index.json puts model.extra.weight in {FIRST}, which does not hold it",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupted_input_is_refused_with_one_line_and_no_output(hf_dir, tmp_path, kind, capsys):
    corrupt, message, *args = CORRUPTIONS[kind]
    corrupt(hf_dir)
    out = tmp_path / "out"
    returncode = convert.main([str(hf_dir), str(out), *(args[0] if args else ())])
    assert_refused(returncode, capsys.readouterr().err, message)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "a temporary directory was left behind"


@pytest.mark.parametrize("error", [KeyError("rope_type"), TypeError("bad type"), AttributeError("no setdefault")])
def test_whatever_the_config_class_raises_is_one_error_line(hf_dir, tmp_path, error, monkeypatch, capsys):
    """HybridConfig's own checks raise ValueError; the code under them may raise anything for a field of the wrong
    type (as `rope_parameters: "llama3"` gave an AttributeError before HybridConfig checked it)."""

    def from_dict(raw):
        raise error

    monkeypatch.setattr(convert.HybridConfig, "from_dict", from_dict)
    returncode = convert.main([str(hf_dir), str(tmp_path / "out")])
    assert_refused(
        returncode, capsys.readouterr().err, f"config.json: not a valid HybridConfig ({type(error).__name__}"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_config_that_builds_no_model_is_one_error_line(hf_dir, tmp_path, monkeypatch, capsys):
    """A config its class accepts may describe no model (an unknown rope_type was a KeyError in the RoPE init):
    the model is built (on the meta device) before any tensor is read."""

    def no_model(config):
        raise KeyError("bogus")

    monkeypatch.setattr(convert, "HybridForCausalLM", no_model)
    returncode = convert.main([str(hf_dir), str(tmp_path / "out")])
    assert_refused(
        returncode, capsys.readouterr().err, "config.json: the model cannot be built from it (KeyError: 'bogus')"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("kind", ["nan", "float16 overflow"])
def test_the_error_is_the_first_and_only_stderr_line_of_the_script(hf_dir, tmp_path, kind):
    """No progress bar before the error (what the in-process test may not see: it runs the script itself)."""
    corrupt, message, *args = CORRUPTIONS[kind]
    corrupt(hf_dir)
    result = run_converter(hf_dir, tmp_path / "out", *(args[0] if args else ()))
    assert_refused(result.returncode, result.stderr, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_module_form_converts_and_refuses_as_the_script_does(hf_dir, tmp_path):
    """`python -m vllm_integration.convert` (Transformers' convert modules run so) is the script: it wrote nothing
    and exited 0 before it called main()."""

    def run(*args) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "vllm_integration.convert", *map(str, args)]
        return subprocess.run(command, cwd=REPO_ROOT, check=False, capture_output=True, text=True, timeout=300)

    converted = run(hf_dir, tmp_path / "out", "--dtype", "bfloat16")
    assert converted.returncode == 0, converted.stderr
    assert convert.main([str(hf_dir), str(tmp_path / "by_main"), "--dtype", "bfloat16"]) == 0
    got, want = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(tmp_path / "by_main" / "model.safetensors"),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    refused = run(hf_dir, tmp_path / "out")  # an existing output, without --force
    assert_refused(refused.returncode, refused.stderr, "exists")


def test_a_sharded_checkpoint_converts_as_the_unsharded_one(hf_dir, tmp_path):
    assert convert.main([str(hf_dir), str(tmp_path / "whole")]) == 0
    shard(hf_dir)
    assert convert.main([str(hf_dir), str(tmp_path / "sharded")]) == 0
    whole, sharded = (
        load_file(tmp_path / "whole" / "model.safetensors"),
        load_file(tmp_path / "sharded" / "model.safetensors"),
    )
    assert set(whole) == set(sharded) and all(torch.equal(whole[name], sharded[name]) for name in whole)


def test_a_float64_checkpoint_is_written_as_float32(hf_dir, tmp_path, capsys):
    corrupt_tensors(hf_dir, lambda t: t.update({name: tensor.double() for name, tensor in t.items()}))
    assert convert.main([str(hf_dir), str(tmp_path / "out")]) == 0
    output = capsys.readouterr()  # the note is a diagnostic, on stderr; stdout has the result only
    assert output.out.splitlines() == [f"wrote the vLLM checkpoint to {tmp_path / 'out'}"]
    assert output.err.splitlines() == ["float64 checkpoint: writing float32 (pass --dtype to choose)"]
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.float32}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert convert.main([str(hf_dir), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert "float64 checkpoint" not in capsys.readouterr().err
    assert load_file(tmp_path / "bf16" / "model.safetensors")[EMBED].dtype == torch.bfloat16


OVERLAPS = {
    "the input": (lambda hf: hf.parent / "." / hf.name, "is the input checkpoint"),
    "inside the input": (lambda hf: hf / "sub", "is inside the input checkpoint"),
    "above the input": (lambda hf: hf.parent, "is inside the output directory"),
}


@pytest.mark.parametrize("where", sorted(OVERLAPS))
def test_an_output_overlapping_the_input_is_refused_even_with_force(tmp_path, where, capsys):
    hf_dir = tmp_path / "above" / "hf"
    HybridForCausalLM(tiny_config()).save_pretrained(hf_dir)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()  # save_pretrained's progress bar
    out, message = OVERLAPS[where]
    returncode = convert.main([str(hf_dir), str(out(hf_dir)), "--force"])
    assert_refused(returncode, capsys.readouterr().err, message)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["above"]


# where -> (HF_DIR, OUT_DIR, the path the error line names), under tmp_path holding `hf`, `loop` -> `loop` and the
# two-link loop `a` -> `b` -> `a`
SYMLINK_LOOPS = {
    "input is a loop": ("loop", "out", "loop"),
    "input under a two-link loop": ("a/hf", "out", "a/hf"),
    "output is a loop": ("hf", "loop", "loop"),
    "output under a two-link loop": ("hf", "a/out", "a/out"),
}


@pytest.mark.parametrize("where", sorted(SYMLINK_LOOPS))
def test_a_path_through_a_symlink_loop_is_refused_with_one_line(hf_dir, tmp_path, where, capsys):
    """A symlink loop is no directory to read or to write (pathlib's resolve raised RuntimeError for it: a
    traceback); `--force` replaces no output it cannot resolve."""
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    source, out, looping = (tmp_path / path for path in SYMLINK_LOOPS[where])
    returncode = convert.main([str(source), str(out), "--force"])
    assert_refused(returncode, capsys.readouterr().err, f"{looping}: {os.strerror(errno.ELOOP)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "hf", "loop"], "something was written"
    assert all(p.is_symlink() for p in (tmp_path / "loop", tmp_path / "a", tmp_path / "b"))


def test_the_symlink_loop_error_is_the_only_stderr_line_of_the_script(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    result = run_converter(tmp_path / "loop", tmp_path / "out")
    assert_refused(result.returncode, result.stderr, f"{tmp_path / 'loop'}: {os.strerror(errno.ELOOP)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=oct)
def test_the_output_directory_has_the_mode_mkdir_gives(hf_dir, tmp_path, umask):
    result = run_converter(hf_dir, tmp_path / "out", umask=umask)
    assert result.returncode == 0, result.stderr
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(0o777 & ~umask)


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


def test_a_mamba2_checkpoint_keeps_its_dynamics_in_fp32(tmp_path):
    model = HybridForCausalLM(
        tiny_config(ssm_type="mamba2", ssm_intermediate_size=48, ssm_head_dim=12, ssm_n_groups=2)
    )
    model.save_pretrained(tmp_path / "hf")
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    converted = load_file(tmp_path / "out" / "model.safetensors")
    prefix = "model.layers.0.self_attn.ssm."
    assert {converted[prefix + name].dtype for name in ("A_log", "D", "dt_bias")} == {torch.float32}
    assert converted[prefix + "in_proj.weight"].dtype == converted[prefix + "norm.weight"].dtype == torch.bfloat16


def test_the_converter_refuses_exactly_the_branch_kinds_the_plugin_does_not_serve():
    pytest.importorskip("vllm")
    from configuration.configuration_hybrid import SSM_TYPES
    from vllm_integration.history import HISTORY_BRANCHES
    from vllm_integration.layout import SERVED_SSM_TYPES

    assert set(SERVED_SSM_TYPES) == set(HISTORY_BRANCHES) <= set(SSM_TYPES)
