"""The Transformers model on its Triton kernels against itself on the PyTorch references: same logits, same
gradients, same cached generation. On CPU machines the kernels run in Triton's interpreter (the model takes them
only for CUDA tensors, so these tests hand them over explicitly); on a GPU, the model picks them by itself."""

import pytest
import torch
from conftest import MAMBA2_BRANCH

from modeling import HybridStaticCache
from modeling.history import mamba1
from modeling.history.mamba1 import Mamba1Branch
from modeling.history.mamba2 import Mamba2Branch

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Hands the Triton kernels (interpreted on CPU) to every SSM branch whose config allows them."""
    if ON_GPU:
        return
    kernels, references = mamba1.KERNEL_OPS, mamba1.REFERENCE_OPS
    monkeypatch.setattr(Mamba1Branch, "_ops_for", lambda self, hidden: kernels if self.use_kernels else references)


def kernel_and_reference_models(make_model, dtype=torch.float32, **overrides):
    """Two copies of one model (same seed): on the kernels, and forced onto the references by its config."""
    kernel_model = make_model(**overrides).to(DEVICE, dtype)
    reference_model = make_model(use_ssm_kernels=False, **overrides).to(DEVICE, dtype)
    return kernel_model, reference_model


def kernels_counting_calls(monkeypatch, *names: str) -> list[str]:
    """Hands every SSM branch the Triton kernels (interpreted on CPU), the ops `names` of them recording their calls
    in the list returned, in call order."""
    calls = []

    def counted(name, op):
        return lambda *args, **kwargs: calls.append(name) or op(*args, **kwargs)

    counting = mamba1.KERNEL_OPS._replace(**{name: counted(name, getattr(mamba1.KERNEL_OPS, name)) for name in names})
    monkeypatch.setattr(Mamba1Branch, "_ops_for", lambda self, hidden: counting)
    return calls


def test_model_picks_kernels_for_cuda_tensors_unless_told_not_to(make_model):
    references = mamba1.REFERENCE_OPS
    ssm = make_model().model.layers[0].self_attn.ssm
    assert ssm._ops_for(torch.randn(1, 3, 48)) == references, "CPU tensors take the reference path"
    if ON_GPU:
        ssm = ssm.cuda()
        hidden = torch.randn(1, 3, 48, device="cuda")
        assert ssm._ops_for(hidden) == mamba1.KERNEL_OPS
        ssm_reference = make_model(use_ssm_kernels=False).model.layers[0].self_attn.ssm.cuda()
        assert ssm_reference._ops_for(hidden) == references


@pytest.mark.parametrize("with_padding", [False, True], ids=["unpadded", "left-padded"])
def test_logits_and_gradients_match_the_reference_path(make_model, kernels_on_cpu, with_padding):
    kernel_model, reference_model = kernel_and_reference_models(make_model)
    kernel_model.train(), reference_model.train()
    input_ids = torch.randint(3, 97, (2, 19), device=DEVICE)
    attention_mask = torch.ones_like(input_ids)
    if with_padding:
        attention_mask[1, :5] = 0
    losses = []
    for model in (kernel_model, reference_model):
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        out.loss.backward()
        losses.append(out)
    torch.testing.assert_close(losses[0].logits, losses[1].logits, atol=1e-4, rtol=1e-4)
    reference_grads = dict(reference_model.named_parameters())
    for name, param in kernel_model.named_parameters():
        torch.testing.assert_close(param.grad, reference_grads[name].grad, atol=2e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_branch_and_the_module_path_give_the_same_output_and_gradients(make_model, monkeypatch, dtype):
    """Without a cache the branch runs as one autograd node (`mamba_inner_fn`) when conv1d, x_proj and dt_proj are
    plain modules; a hook on one of them (as an adapter or a quantised layer would be) sends it through the modules
    one by one. Both paths compute the same function, over padded rows too."""
    calls = kernels_counting_calls(monkeypatch, "mamba_inner", "selective_scan")
    model = make_model().to(DEVICE, dtype).train()
    ssm = model.model.layers[0].self_attn.ssm
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 13, model.config.hidden_size, generator=generator).to(DEVICE, dtype)
    padding_mask = torch.ones(2, 13, dtype=torch.long, device=DEVICE)
    padding_mask[1, :4] = 0
    dy = torch.randn(2, 13, ssm.out_proj.out_features, generator=generator).to(DEVICE, dtype)
    results = {}
    for path in ("fused", "modules"):
        hook = ssm.x_proj.register_forward_hook(lambda *args: None) if path == "modules" else None
        model.zero_grad()
        leaf = hidden.clone().requires_grad_()
        calls.clear()
        out = ssm(leaf, padding_mask=padding_mask)
        assert calls == (["mamba_inner"] if path == "fused" else ["selective_scan"]), (path, calls)
        (out * dy).sum().backward()
        results[path] = (out.detach(), leaf.grad, {n: p.grad.clone() for n, p in ssm.named_parameters()})
        if hook is not None:
            hook.remove()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    (out_f, dh_f, grads_f), (out_m, dh_m, grads_m) = results["fused"], results["modules"]
    torch.testing.assert_close(out_f, out_m, **tol)
    torch.testing.assert_close(dh_f, dh_m, **tol)
    for name, grad in grads_f.items():
        torch.testing.assert_close(grad, grads_m[name], **tol, msg=name)


def test_training_keeps_no_float32_copy_of_the_step_for_backward(make_model, kernels_on_cpu):
    """The step's softplus runs inside the scan, so what the backward keeps of dt is dt_proj's output in the model's
    dtype, not float32 [B, T, E] tensors from before and after an elementwise softplus (2x bf16's bytes each: 1.2 GB
    of a 416M model's 4 GB extra activations at B 2, T 4096)."""
    model = make_model().to(DEVICE, torch.bfloat16).train()
    ssm = model.model.layers[0].self_attn.ssm
    batch, seq_len = 2, 19
    hidden = torch.randn(batch, seq_len, model.config.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = ssm(hidden.requires_grad_())
    token_channel = (batch, seq_len, ssm.intermediate_size)
    kept = [(t.dtype, tuple(t.shape)) for t in saved if t.dim() == 3 and tuple(t.shape) == token_channel]
    assert (torch.bfloat16, token_channel) in kept, f"the hook saw the [B, T, E] activations: {kept}"
    assert (torch.float32, token_channel) not in kept, f"a float32 [B, T, E] tensor is kept for backward: {kept}"
    out.float().square().sum().backward()
    assert ssm.dt_proj.bias.grad is not None and ssm.dt_proj.bias.grad.abs().sum() > 0


def test_cached_generation_matches_the_reference_path(make_model, kernels_on_cpu):
    """Prefill, then decoding with the cached conv history and state: the kernels' initial-state paths."""
    kernel_model, reference_model = kernel_and_reference_models(make_model)
    input_ids = torch.randint(3, 97, (2, 11), device=DEVICE)
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = kernel_model.generate(input_ids, **kwargs)
        ref = reference_model.generate(input_ids, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_step_and_the_module_path_give_the_same_steps(make_model, monkeypatch, dtype):
    """A cached one-token step runs the branch as one op (`mamba_inner_step`) when conv1d, x_proj and dt_proj are
    plain modules, and through the modules one by one (conv update, x_proj, dt_proj, state update) when one of them
    has a hook, as an adapter would: the same logits and caches over three steps of a left-padded batch, the last
    step's token of row 1 a padding token (its state kept)."""
    calls = kernels_counting_calls(monkeypatch, "mamba_inner_step", "state_update")
    model = make_model().to(DEVICE, dtype).eval()
    num_layers = model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 97, (2, 9), generator=generator).to(DEVICE)
    steps = torch.randint(3, 97, (2, 3), generator=generator).to(DEVICE)
    mask = torch.ones(2, 12, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0
    mask[1, -1] = 0
    results = {}
    for path in ("fused", "modules"):
        layers = model.model.layers if path == "modules" else []
        hooks = [layer.self_attn.ssm.x_proj.register_forward_hook(lambda *args: None) for layer in layers]
        with torch.no_grad():
            cache = model(ids, attention_mask=mask[:, :9], use_cache=True).past_key_values
            logits = []
            for t in range(3):
                calls.clear()
                step_mask = mask[:, : 10 + t]
                out = model(steps[:, t : t + 1], attention_mask=step_mask, past_key_values=cache, use_cache=True)
                assert calls == ["mamba_inner_step" if path == "fused" else "state_update"] * num_layers, calls
                logits.append(out.logits)
        layers = [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for layer in cache.layers]
        results[path] = (torch.cat(logits, dim=1), layers)
        for hook in hooks:
            hook.remove()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    (fused_logits, fused_layers), (module_logits, module_layers) = results["fused"], results["modules"]
    torch.testing.assert_close(fused_logits, module_logits, **tol)
    for (conv, state), (ref_conv, ref_state) in zip(fused_layers, module_layers):
        torch.testing.assert_close(conv, ref_conv, **tol)
        torch.testing.assert_close(state, ref_state, **tol)


@pytest.mark.parametrize("branch", [{}, MAMBA2_BRANCH], ids=["mamba1", "mamba2"])
def test_a_decode_step_on_the_kernels_compiles_to_one_graph(make_model, kernels_on_cpu, monkeypatch, branch):
    """A one-token step on a HybridStaticCache under `torch.compile(fullgraph=True)`, as `generate()` compiles it
    (masks built outside the graph by `create_masks_for_generate`): the branch's decode step enters the graph as its
    custom op (`mamba_inner_step`, `mamba2_inner_step`), not as a graph break, and the compiled step gives the eager
    step's logits and caches."""
    if not ON_GPU:
        monkeypatch.setattr(Mamba2Branch, "_on_kernels", lambda self, hidden: self.use_kernels)
    model = make_model(**branch).to(DEVICE)
    ids = torch.randint(3, 97, (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    next_ids = torch.randint(3, 97, (2, 1), device=DEVICE)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    compiled_forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    results = []
    for forward in (model.forward, compiled_forward):
        cache = HybridStaticCache(model.config, max_cache_len=12)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            masks = model.create_masks_for_generate(
                config=model.config,
                inputs_embeds=torch.empty(2, 1, 0, device=DEVICE),
                attention_mask=step_mask,
                past_key_values=cache,
            )
            positions = torch.full((2, 1), ids.shape[1], device=DEVICE)
            logits = forward(next_ids, attention_mask=masks, past_key_values=cache, position_ids=positions).logits
        results.append((logits, [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers]))
    (eager, eager_states), (compiled, compiled_states) = results
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for (conv, state), (ref_conv, ref_state) in zip(compiled_states, eager_states):
        torch.testing.assert_close(conv, ref_conv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, ref_state, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(
    not ON_GPU, reason="Dynamo traces Triton launches on CUDA only (the interpreter's are opaque to it)"
)
@pytest.mark.parametrize("branch", [{}, MAMBA2_BRANCH], ids=["mamba1", "mamba2"])
def test_a_training_step_on_the_kernels_compiles_to_one_graph(make_model, branch):
    """`torch.compile(fullgraph=True)` of a training forward on the kernels, as `Trainer(torch_compile=True)` compiles
    the model: Dynamo traces the branch's autograd functions and their Triton launches without a graph break (the
    README says so), and the compiled step's loss and gradients are eager's. Mamba-2 over three of its scan's chunks."""
    model = make_model(sliding_window=16, attn_implementation="sdpa", **branch).to(DEVICE).train()
    ids = torch.randint(3, 97, (2, 80 if not branch else 150), device=DEVICE)
    steps = []
    for forward in (model.forward, torch.compile(model.forward, fullgraph=True)):
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        steps.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = steps
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    for name, grad in compiled_grads.items():
        torch.testing.assert_close(
            grad, eager_grads[name], atol=1e-4, rtol=1e-3, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["rows", "packed-rows"])
def test_no_training_launch_passes_one_tensor_as_two_arguments(make_model, kernels_on_cpu, monkeypatch, packed):
    """Under torch.compile, Dynamo traces the training step's Triton launches, and functionalizing a launch clones
    every argument that Inductor's analysis of the kernel says it may write (the analysis over-approximates: every
    argument of a helper a store depends on), then replaces each such tensor by its clone, in argument order. One
    tensor passed as two arguments, the scan's output standing in for its absent pointers, came back as the clone of
    the last of them, which the kernel never writes: the compiled step's loss was off by 3-4e-3, differently in every
    process (H200). So no launch of the training forward or backward passes one tensor twice; absent pointers are
    None."""
    from triton.runtime import interpreter, jit

    launches = []
    launcher_class, method = (jit.JITFunction, "run") if ON_GPU else (interpreter.GridExecutor, "__call__")
    launch = getattr(launcher_class, method)

    def recording(self, *args, **kwargs):
        tensors = [(f"#{i}", arg) for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        tensors += [(name, arg) for name, arg in kwargs.items() if isinstance(arg, torch.Tensor)]
        launches.append((getattr(self, "fn", self).__name__, tensors))
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(launcher_class, method, recording)
    model = make_model(sliding_window=16).to(DEVICE).train()
    ids = torch.randint(3, 97, (2, 150), device=DEVICE)  # more than one scan chunk: the combine runs both ways
    # Packed rows (DataCollatorWithFlattening's position_ids, two sequences a row) pass seq_idx to every launch.
    positions = torch.cat([torch.arange(70), torch.arange(80)]).expand(2, -1).to(DEVICE) if packed else None
    model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()

    traced = {"_selective_scan_chunk_combine_kernel", "_selective_scan_bwd_kernel", "_causal_conv1d_bwd_kernel"}
    assert traced <= {name for name, _ in launches}
    assert packed == any(name == "p_seq_idx" for _, tensors in launches for name, _ in tensors)
    for kernel, tensors in launches:
        by_address = {}
        for name, tensor in tensors:
            if tensor.numel():
                by_address.setdefault(tensor.data_ptr(), []).append(name)
        shared = [names for names in by_address.values() if len(names) > 1]
        assert not shared, f"{kernel} takes one tensor as {shared}"


@pytest.mark.skipif(not ON_GPU, reason="generate() compiles its decode step (CUDA graphs) on CUDA only")
def test_compiled_static_generation_gives_the_dynamic_cache_tokens_on_gpu(make_model):
    """`generate(cache_implementation="static")` on CUDA compiles the decode step (inductor, CUDA graphs) around the
    kernels' custom ops; its tokens are the uncompiled dynamic cache's."""
    model = make_model(hidden_size=256, ssm_intermediate_size=512, sliding_window=64).to(DEVICE)
    input_ids = torch.randint(3, 97, (4, 100), device=DEVICE)
    kwargs = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(input_ids, **kwargs)
        static = model.generate(input_ids, cache_implementation="static", **kwargs)
    assert isinstance(static.past_key_values, HybridStaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="bf16 parity of the compiled kernels is checked on a GPU")
def test_bf16_logits_match_the_reference_path_on_gpu(make_model):
    kernel_model, reference_model = kernel_and_reference_models(
        make_model, torch.bfloat16, hidden_size=256, ssm_intermediate_size=512, sliding_window=64
    )
    input_ids = torch.randint(3, 97, (4, 300), device=DEVICE)
    with torch.no_grad():
        logits = kernel_model(input_ids).logits.float()
        reference = reference_model(input_ids).logits.float()
    # Both paths keep the state in fp32; they differ in bf16 rounding of u, y and the conv.
    assert ((logits - reference).norm() / reference.norm()).item() < 1e-2
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.97


def test_packed_training_on_the_kernels_gives_each_sequence_its_own_loss_and_gradients(make_model, kernels_on_cpu):
    """Padding-free packing (DataCollatorWithFlattening) on the Triton conv and scan: every packed sequence gets the
    logits it gets alone, and the packed loss and gradients are the sums of the sequences' own (test_packing.py
    checks the same on the references)."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (7, 2, 1, 11, 3, 9)]
    model = make_model().to(DEVICE).train()
    batch = DataCollatorWithFlattening()([{"input_ids": ids} for ids in sequences])
    out = model(**{k: v.to(DEVICE) for k, v in batch.items()})
    (out.loss * (batch["labels"][:, 1:] != -100).sum()).backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    start = 0
    for ids in sequences:
        ids = torch.tensor([ids], device=DEVICE)
        alone = model(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits[:, start : start + ids.shape[1]], alone.logits, atol=1e-4, rtol=1e-4)
        if ids.shape[1] > 1:
            (alone.loss * (ids.shape[1] - 1)).backward()
        start += ids.shape[1]
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=2e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_mamba2_training_on_the_kernels_is_the_reference_path(make_model, monkeypatch, packed):
    """The Mamba-2 branch's training forward and backward on its kernels (the conv's and the chunked scan's; on CPU
    machines in Triton's interpreter, handed over explicitly) against the same model on the references: logits and
    every parameter's gradient, over rows of two chunks of the scan's kernels (64 tokens each), and over packed rows
    (position_ids restarting: seq_idx)."""
    if not ON_GPU:
        monkeypatch.setattr(Mamba2Branch, "_on_kernels", lambda self, hidden: self.use_kernels)
    kernel_model, reference_model = kernel_and_reference_models(make_model, **MAMBA2_BRANCH)
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 97, (2, 90), generator=generator).to(DEVICE)
    kwargs = {"labels": input_ids}
    if packed:  # row 0: sequences of 30, 1 and 59 tokens; row 1: one sequence
        starts = torch.tensor([0, 30, 31])
        positions = torch.arange(90) - starts[torch.searchsorted(starts, torch.arange(90), right=True) - 1]
        kwargs["position_ids"] = torch.stack([positions, torch.arange(90)]).to(DEVICE)
    outputs = []
    for model in (kernel_model, reference_model):
        model.train()
        out = model(input_ids, **kwargs)
        out.loss.backward()
        outputs.append((out.logits, {name: param.grad for name, param in model.named_parameters()}))
    (logits, grads), (want_logits, want_grads) = outputs
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=2e-4, rtol=1e-3, msg=name)


def test_mamba2_heads_wider_than_the_scan_kernels_take_run_the_reference_scan(make_model, monkeypatch):
    """ssm_head_dim above what the scan's kernels hold (128): the branch keeps its other kernels and runs the scan's
    reference, with a warning, instead of failing in the middle of training."""
    from modeling.ops.ssd.forward import MAX_HEAD_DIM

    if not ON_GPU:
        monkeypatch.setattr(Mamba2Branch, "_on_kernels", lambda self, hidden: self.use_kernels)
    wide = {
        **MAMBA2_BRANCH,
        "ssm_intermediate_size": MAX_HEAD_DIM + 8,
        "ssm_head_dim": MAX_HEAD_DIM + 8,
        "ssm_n_groups": 1,
    }
    kernel_model, reference_model = kernel_and_reference_models(make_model, **wide)
    input_ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(kernel_model(input_ids).logits, reference_model(input_ids).logits)


@pytest.mark.skipif(not ON_GPU, reason="the Mamba-2 branch takes its kernels for CUDA tensors only")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mamba2_generation_on_the_kernels_is_the_reference_paths(make_model, cache):
    """The Mamba-2 branch on CUDA (the conv's, the scan's and the norm's Triton kernels, the decode update's
    kernel) against the same model forced onto the references: greedy tokens and logits, prefill and cached decode
    steps, with the dynamic cache and with the static one (its decode step compiled by generate())."""
    kernel_model, reference_model = kernel_and_reference_models(make_model, **MAMBA2_BRANCH)
    input_ids = torch.randint(3, 97, (2, 11), device=DEVICE)
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = kernel_model.generate(input_ids, cache_implementation=cache, **kwargs)
        ref = reference_model.generate(input_ids, cache_implementation=cache, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)
