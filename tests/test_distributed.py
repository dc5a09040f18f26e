"""The model in other processes (issue 19, items 5 and 3): registered in a process that only unpickles a config (a
spawned worker; the pickle names `modeling.HybridConfig`) while `configuration` imports nothing of `modeling`, FSDP
training on two CPU processes, and tensor parallelism through `from_pretrained(..., tp_plan="auto")`.

Nothing of `configuration` or `modeling` is imported at the top: a spawned worker imports this module to find its
function and must start without them. The two-process tests run this file under `torchrun` (see `__main__`).
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]

GLOBAL_BATCH, SEQ_LEN, STEPS, LR = 4, 20, 4, 1e-2


def _env() -> dict[str, str]:
    # One thread per process: two workers on two cores, and fp32 sums in a fixed order.
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


def _tiny_config(**overrides):
    """conftest's tiny model, with a vocabulary that two tensor-parallel ranks split evenly (`lm_head` gathers a
    colwise output). Imported here, not at the top: conftest imports `configuration` and `modeling`."""
    from conftest import tiny_config

    return tiny_config(vocab_size=96, **overrides)


def _batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator)


def _torchrun(*args: str, timeout: int = 240) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*command, __file__, *args], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]


# --- Registration: from a config's pickle alone; `configuration` below `modeling` ----------------------------------


def test_unpickling_a_config_alone_registers_the_models():
    code = f"""
import pickle
import sys
from transformers import AutoModel, AutoModelForCausalLM
config = pickle.loads({pickle.dumps(_tiny_config())!r})
assert "modeling" in sys.modules, "unpickling imports `modeling`, the config class's public module"
assert type(AutoModelForCausalLM.from_config(config)).__name__ == "HybridForCausalLM"
assert type(AutoModel.from_config(config)).__name__ == "HybridModel"
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_configuration_imports_nothing_of_modeling():
    """The ground floor stays below the floor above: `configuration` registers the config with AutoConfig alone
    (what vLLM's plugin imports in every process), and `modeling` registers the model classes."""
    code = """
import sys
import configuration
from transformers import AutoConfig
ours = sorted(name for name in sys.modules if name.split(".")[0] in ("modeling", "vllm_integration"))
assert not ours, f"`import configuration` imported {ours}"
assert type(AutoConfig.for_model("hybrid")) is configuration.HybridConfig
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize(
    "first", ["import modeling", "from modeling import HybridForCausalLM", "import vllm_integration"]
)
def test_no_circular_import(first):
    code = f"{first}\nfrom configuration import HybridConfig\nfrom modeling import HybridForCausalLM\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _spawned_build(rank: int, pickled_config: bytes, out_path: str) -> None:
    assert "configuration" not in sys.modules and "modeling" not in sys.modules, "the worker started with them"
    from transformers import AutoModelForCausalLM

    config = pickle.loads(pickled_config)  # imports `modeling` (the class's public module), which registers the models
    model = AutoModelForCausalLM.from_config(config)
    logits = model(torch.arange(8)[None]).logits
    Path(out_path).write_text(json.dumps({"class": type(model).__name__, "shape": list(logits.shape)}))


def test_spawned_worker_builds_the_model_from_an_unpickled_config(tmp_path):
    config = _tiny_config()
    out_path = tmp_path / "spawned.json"
    torch.multiprocessing.spawn(
        _spawned_build, args=(pickle.dumps(config), str(out_path)), nprocs=1, start_method="spawn"
    )
    assert json.loads(out_path.read_text()) == {"class": "HybridForCausalLM", "shape": [1, 8, config.vocab_size]}


# --- FSDP: two CPU processes (gloo) train as one on the same global batch -----------------------------------------


def _train(model, input_ids: torch.Tensor, reduce_loss) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(reduce_loss(loss.detach()).item())
    return losses


def _fresh_model():
    from transformers import AutoModelForCausalLM

    config = _tiny_config()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _finish() -> None:
    # Both ranks leave together: a rank that tore gloo down while the other still used it sometimes aborted at exit
    # ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_worker(out_path: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _fresh_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    rows = GLOBAL_BATCH // world_size

    def mean_over_ranks(loss):
        dist.all_reduce(loss)
        return loss / world_size

    losses = _train(model, _batch(model.config.vocab_size)[rank * rows : (rank + 1) * rows], mean_over_ranks)
    if rank == 0:
        Path(out_path).write_text(json.dumps(losses))
    _finish()


def test_fsdp_two_processes_train_as_one(tmp_path):
    torch.set_num_threads(1)
    model = _fresh_model()
    single = _train(model, _batch(model.config.vocab_size), lambda loss: loss)
    _torchrun("fsdp", str(tmp_path / "fsdp.json"))
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())
    assert single[-1] < single[0]  # it trains
    assert fsdp == pytest.approx(single, abs=1e-5, rel=1e-5), (fsdp, single)


# --- Tensor parallelism: from_pretrained(tp_plan="auto") on two CPU processes --------------------------------------


def _tp_worker(model_dir: str, out_dir: str) -> None:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import modeling  # noqa: F401  (registers model_type "hybrid" and the model classes: `from_pretrained` reads them)

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    input_ids = _batch(reference.config.vocab_size)[:2]
    sharded = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation="eager")
    rank = dist.get_rank()
    with torch.no_grad():
        no_grad_error = (sharded(input_ids).logits - reference(input_ids).logits).abs().max().item()
    # With gradients on, the styles run their DTensor path; the gradients of sharded and replicated weights alike
    # must be the unsharded model's.
    logits = {}
    for key, model in (("reference", reference), ("sharded", sharded)):
        logits[key] = model(input_ids).logits
        logits[key].float().square().mean().backward()
    logits_error = (logits["sharded"] - logits["reference"]).abs().max().item()
    reference_grads = {name: parameter.grad for name, parameter in reference.named_parameters()}
    grad_error, sharded_names = 0.0, []
    for name, parameter in sharded.named_parameters():
        grad = parameter.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
            sharded_names.append(name)
        grad_error = max(grad_error, (grad - reference_grads[name]).abs().max().item())
    results = {
        "no_grad": no_grad_error,
        "logits": logits_error,
        "grads": grad_error,
        "sharded": sharded_names,
        "tp_size": sharded.tp_size,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    _finish()


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
def test_tensor_parallel_from_pretrained_gives_the_unsharded_logits(tmp_path, ssm_type):
    """Mamba-2's in_proj (132 outputs here) is split over the two ranks and gathered, as Mamba-1's."""
    from conftest import MAMBA2_BRANCH

    from modeling import HybridForCausalLM

    config = _tiny_config(**(MAMBA2_BRANCH if ssm_type == "mamba2" else {}))
    torch.manual_seed(0)
    model = HybridForCausalLM(config)
    with torch.no_grad():  # out_proj starts at zero: give the SSM branch something to add
        for layer in model.model.layers:
            layer.self_attn.ssm.out_proj.weight.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "model")
    _torchrun("tp", str(tmp_path / "model"), str(tmp_path))
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["tp_size"] == 2
        assert "model.layers.0.self_attn.ssm.out_proj.weight" in results["sharded"]
        assert "model.layers.0.self_attn.ssm.in_proj.weight" in results["sharded"]
        assert results["no_grad"] < 1e-5 and results["logits"] < 1e-5, results
        assert results["grads"] < 1e-5, results


if __name__ == "__main__":  # under torchrun: `python -m torch.distributed.run ... test_distributed.py fsdp|tp ...`
    torch.set_num_threads(1)
    {"fsdp": _fsdp_worker, "tp": _tp_worker}[sys.argv[1]](*sys.argv[2:])
    # Skips the interpreter's teardown: under load a rank sometimes aborted in it after a clean finish ("terminate
    # called without an active exception", a C++ thread left at exit), which torchrun reports as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
