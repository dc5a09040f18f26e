"""The Transformers model against independent references: naive loops, Mistral, itself without the cache."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import MAMBA2_BRANCH, DispatchedOps, backward_elements, tiny_config
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from modeling import HybridCache, HybridForCausalLM, HybridModel, HybridStaticCache
from modeling.ops import rms_normalize_heads, selective_scan_ref

ATOL = 2e-5


def naive_ssm_branch(ssm, h: torch.Tensor) -> torch.Tensor:
    """docs/DESIGN.md's SSM branch for one unpadded sequence h [T, hidden], one time step and one channel group at a
    time, in float64."""
    h = h.double()
    E, N, K, R = ssm.intermediate_size, ssm.state_size, ssm.conv_kernel_size, ssm.dt_rank
    W_in = ssm.in_proj.weight.double()
    conv_w, conv_b = ssm.conv1d.weight.double()[:, 0, :], ssm.conv1d.bias.double()
    W_x, W_dt, b_dt = ssm.x_proj.weight.double(), ssm.dt_proj.weight.double(), ssm.dt_proj.bias.double()
    A = -torch.exp(ssm.A_log.double())
    D, W_out = ssm.D.double(), ssm.out_proj.weight.double()
    state = torch.zeros(E, N, dtype=torch.float64)
    outputs = []
    for t in range(h.shape[0]):
        xz_hist = [W_in @ h[s] if s >= 0 else torch.zeros(2 * E, dtype=torch.float64) for s in range(t - K + 1, t + 1)]
        z = xz_hist[-1][E:]
        conv = conv_b.clone()
        for k in range(K):
            conv += conv_w[:, k] * xz_hist[k][:E]
        u = F.silu(conv)
        dtBC = W_x @ u
        dt = F.softplus(W_dt @ dtBC[:R] + b_dt)
        B, C = dtBC[R : R + N], dtBC[R + N :]
        state = torch.exp(dt[:, None] * A) * state + (dt * u)[:, None] * B[None, :]
        y = state @ C + D * u
        outputs.append(W_out @ (y * F.silu(z)))
    return torch.stack(outputs)


def test_ssm_branch_matches_naive_loop(make_model):
    model = make_model()
    ssm = model.model.layers[1].self_attn.ssm
    h = torch.randn(2, 23, model.config.hidden_size)
    with torch.no_grad():
        out = ssm(h)
    for b in range(2):
        torch.testing.assert_close(out[b].double(), naive_ssm_branch(ssm, h[b]), atol=ATOL, rtol=1e-4)


def test_selective_scan_ref_continues_from_initial_state():
    torch.manual_seed(0)
    Bsz, T, E, N = 2, 13, 6, 5
    u, z = torch.randn(Bsz, T, E), torch.randn(Bsz, T, E)
    dt = F.softplus(torch.randn(Bsz, T, E))
    A = -torch.rand(E, N) * 3
    B, C, D = torch.randn(Bsz, T, N), torch.randn(Bsz, T, N), torch.randn(E)
    y_full, state_full = selective_scan_ref(u, dt, A, B, C, D, z)
    y1, s1 = selective_scan_ref(u[:, :5], dt[:, :5], A, B[:, :5], C[:, :5], D, z[:, :5])
    y2, s2 = selective_scan_ref(u[:, 5:], dt[:, 5:], A, B[:, 5:], C[:, 5:], D, z[:, 5:], initial_state=s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full)
    torch.testing.assert_close(s2, state_full)
    assert state_full.dtype == torch.float32


def test_selective_scan_ref_backward_grows_linearly_with_the_length():
    """The reference is the model's CPU training path: its backward may not write a whole-sequence tensor at every
    step. Indexing each step out of the [B, T, E, N] decay and drive did (each index's gradient is zeros of the whole:
    ~2T such tensors, minutes for one training step at T 1024); a few of them is linear."""
    torch.manual_seed(0)
    Bsz, T, E, N = 2, 256, 6, 4
    u, z, dt = (torch.randn(Bsz, T, E, requires_grad=True) for _ in range(3))
    A = (-torch.rand(E, N) * 3).requires_grad_()
    B, C = torch.randn(Bsz, T, N, requires_grad=True), torch.randn(Bsz, T, N, requires_grad=True)
    y, _ = selective_scan_ref(u, dt, A, B, C, torch.randn(E), z, dt_softplus=True)
    whole = Bsz * T * E * N
    assert backward_elements(y) < 60 * whole  # ~24 with unbind, ~1,040 with indexing
    assert all(t.grad is not None for t in (u, z, dt, A, B, C))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_full_forward_equals_token_by_token_decoding(make_model, attn_implementation):
    model = make_model(attn_implementation=attn_implementation)
    ids = torch.randint(3, 97, (2, 4 * model.config.sliding_window + 3))  # prompts several windows long
    with torch.no_grad():
        full = model(ids).logits
        cache = HybridCache(model.config)
        steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=1e-4)
    # The sliding layers keep only W-1 keys; the full layer keeps everything.
    assert cache.layers[0].keys.shape[-2] == model.config.sliding_window - 1
    assert cache.layers[1].keys.shape[-2] == ids.shape[1]
    assert cache.layers[0].recurrent_states[0].dtype == torch.float32


@pytest.mark.parametrize("splits", [[1, 9, 18], [5, 6, 7], [13], [2, 3, 4, 20]], ids=lambda s: "-".join(map(str, s)))
def test_chunked_prefill_equals_one_pass(make_model, splits):
    model = make_model()
    ids = torch.randint(3, 97, (2, 27))
    with torch.no_grad():
        full = model(ids).logits
        cache = HybridCache(model.config)
        chunks, start = [], 0
        for end in splits + [ids.shape[1]]:
            chunks.append(model(ids[:, start:end], past_key_values=cache, use_cache=True).logits)
            start = end
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=ATOL, rtol=1e-4)


def test_attention_path_matches_mistral_when_ssm_is_off(make_model):
    model = make_model(use_ssm_branch=False, layer_types=["sliding_attention"] * 3)
    config = model.config
    mistral_config = config.attention_only_config()
    assert isinstance(mistral_config, MistralConfig) and mistral_config.sliding_window == config.sliding_window
    mistral = MistralForCausalLM(mistral_config).eval()
    missing, unexpected = mistral.load_state_dict(model.state_dict(), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(3, 97, (2, 31))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in one row
    for implementation in ["eager", "sdpa"]:
        model.set_attn_implementation(implementation)
        mistral.set_attn_implementation(implementation)
        with torch.no_grad():
            torch.testing.assert_close(
                model(ids, attention_mask=mask).logits, mistral(ids, attention_mask=mask).logits
            )
    with torch.no_grad():
        ours = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
        theirs = mistral.generate(ids[:1], max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)


def one_cpu_thread_for(attn_implementation: str) -> None:
    """One CPU thread for flex attention (conftest's `torch_threads_restored` gives the count back after the test):
    Inductor's CPU flex kernel corrupts the heap when it runs on more than one thread on some hosts
    (pytorch/pytorch#153145, open; here a 2-core AMD EPYC, torch 2.11: "corrupted double-linked list", then an abort
    that takes the whole test run with it). The other implementations keep the host's threads."""
    if attn_implementation == "flex_attention":
        torch.set_num_threads(1)


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    return ids, mask


def test_left_padded_batch_equals_each_prompt_alone(make_model):
    model = make_model()
    prompts = [torch.randint(3, 97, (n,)) for n in (25, 9, 17, 2)]
    ids, mask = left_pad(prompts, model.config.pad_token_id)
    with torch.no_grad():
        batched_logits = model(ids, attention_mask=mask).logits
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        for row, prompt in enumerate(prompts):
            alone_logits = model(prompt[None]).logits[0]
            torch.testing.assert_close(batched_logits[row, -len(prompt) :], alone_logits, atol=ATOL, rtol=1e-4)
            alone = model.generate(prompt[None], max_new_tokens=10, do_sample=False)
            assert torch.equal(batched[row, -10:], alone[0, -10:])


def test_padding_never_enters_the_ssm_state(make_model):
    """Whatever the padded positions hold, the states after the prompt are the same."""
    model = make_model()
    prompt = torch.randint(3, 97, (11,))
    caches = []
    for pad_tokens in (torch.randint(3, 97, (7,)), torch.randint(3, 97, (7,))):
        ids = torch.cat([pad_tokens, prompt])[None]
        mask = torch.cat([torch.zeros(7, dtype=torch.long), torch.ones(11, dtype=torch.long)])[None]
        cache = HybridCache(model.config)
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        caches.append(cache)
    alone = HybridCache(model.config)
    with torch.no_grad():
        model(prompt[None], past_key_values=alone, use_cache=True)
    for layer_idx in range(model.config.num_hidden_layers):
        for cache in caches:
            torch.testing.assert_close(
                cache.layers[layer_idx].recurrent_states[0],
                alone.layers[layer_idx].recurrent_states[0],
                atol=ATOL,
                rtol=1e-4,
            )
            torch.testing.assert_close(cache.layers[layer_idx].conv_states[0], alone.layers[layer_idx].conv_states[0])


def test_a_padding_decode_step_does_what_the_scan_does_with_padding(make_model):
    """A one-token step whose token is padding (the decode ops) leaves the caches as the scan path leaves them for
    the same padded token inside a longer forward: its zeroed input enters the conv history, the state is
    unchanged; and the next real token then gives the same logits."""
    model = make_model()
    ids = torch.randint(3, 97, (2, 14))
    mask = torch.ones_like(ids)
    mask[1, 12] = 0  # row 1's token 12 is padding; row 0 decodes as usual
    stepped, one_pass = HybridCache(model.config), HybridCache(model.config)
    with torch.no_grad():
        model(ids[:, :12], attention_mask=mask[:, :12], past_key_values=stepped, use_cache=True)
        for t in (12, 13):  # two decode steps (the decode ops), the first one padding in row 1
            last = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=stepped, use_cache=True)
        reference = model(ids, attention_mask=mask, past_key_values=one_pass, use_cache=True)
    torch.testing.assert_close(last.logits[:, -1], reference.logits[:, -1], atol=ATOL, rtol=1e-4)
    for a, b in zip(stepped.layers, one_pass.layers):
        torch.testing.assert_close(a.conv_states[0], b.conv_states[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(
    "generate_kwargs",
    [
        dict(do_sample=False),
        dict(num_beams=3, do_sample=False),
        dict(num_beams=2, num_return_sequences=2, do_sample=False),
    ],
    ids=["greedy", "beam3", "beam2x2"],
)
def test_generate_with_cache_equals_recomputing_everything(make_model, generate_kwargs):
    model = make_model()
    prompts = [torch.randint(3, 97, (n,)) for n in (19, 12)]
    ids, mask = left_pad(prompts, model.config.pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=9, pad_token_id=0, **generate_kwargs)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        recomputed = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape[1] == ids.shape[1] + 9
    assert torch.equal(cached, recomputed)


def test_sampling_is_reproducible_and_uses_the_distribution(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (3, 14))
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(model.generate(ids, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=8))
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(7)
    other = model.generate(ids, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=8)
    assert not torch.equal(other, outs[0])


def test_forward_options(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (2, 10))
    labels = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        out = model(ids, labels=labels, output_hidden_states=True)
        expected_loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1))
        torch.testing.assert_close(out.loss, expected_loss)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        last = model(ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, out.logits[:, -1:])
        as_tuple = model(ids, return_dict=False)
        assert isinstance(as_tuple, tuple)
        torch.testing.assert_close(as_tuple[0], out.logits)
        # Explicit positions that equal the default ones change nothing.
        positions = torch.arange(10)[None].expand(2, -1)
        torch.testing.assert_close(model(ids, position_ids=positions).logits, out.logits)


def test_save_load_and_auto_round_trip(make_model, tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).model_type == "hybrid"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert isinstance(loaded, HybridForCausalLM)
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, HybridModel)
    ids = torch.randint(3, 97, (2, 15))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    for name, param in model.state_dict().items():
        assert torch.equal(param, loaded.state_dict()[name]), name


def test_parameter_names_and_shapes_follow_the_design():
    config = tiny_config()
    model = HybridForCausalLM(config)
    E, N, K, R = config.ssm_intermediate_size, config.ssm_state_size, config.ssm_conv_kernel_size, config.ssm_dt_rank
    HD = config.num_attention_heads * config.head_dim
    prefix = "model.layers.0.self_attn.ssm."
    expected = {
        "in_proj.weight": (2 * E, config.hidden_size),
        "conv1d.weight": (E, 1, K),
        "conv1d.bias": (E,),
        "x_proj.weight": (R + 2 * N, E),
        "dt_proj.weight": (E, R),
        "dt_proj.bias": (E,),
        "A_log": (E, N),
        "D": (E,),
        "out_proj.weight": (HD, E),
    }
    params = dict(model.named_parameters())
    for name, shape in expected.items():
        assert tuple(params[prefix + name].shape) == shape, name
    assert tuple(params["model.layers.0.self_attn.o_proj.weight"].shape) == (config.hidden_size, HD)


def test_initialisation_follows_mamba_with_a_quarter_of_the_channels_near_no_decay():
    """Mamba's initialisation (S4D-real rates 1..N per channel), except that by default the last quarter of the
    channels start with rates 1e4 times smaller (`ssm_slow_channel_fraction=0.25`); 0 keeps Mamba's throughout."""
    config = tiny_config(ssm_dt_min=0.002, ssm_dt_max=0.05)
    ssm = HybridForCausalLM(config).model.layers[0].self_attn.ssm
    s4d_real = torch.arange(1, 9.0).expand(40, -1)
    torch.testing.assert_close(ssm.A_log.exp(), torch.cat([s4d_real[:30], s4d_real[30:] * 1e-4]))
    plain = HybridForCausalLM(tiny_config(ssm_slow_channel_fraction=0.0)).model.layers[0].self_attn.ssm
    torch.testing.assert_close(plain.A_log, s4d_real.log())
    torch.testing.assert_close(ssm.D, torch.ones(40))
    dt = F.softplus(ssm.dt_proj.bias)
    assert dt.min() >= 0.002 * 0.999 and dt.max() <= 0.05 * 1.001
    assert torch.count_nonzero(ssm.out_proj.weight) == 0
    # The input side keeps PyTorch's default (Mamba's) init: uniform within 1/sqrt(fan_in), not the 0.02 of the
    # other projections.
    for weight, fan_in in (
        (ssm.in_proj.weight, config.hidden_size),
        (ssm.conv1d.weight, config.ssm_conv_kernel_size),
        (ssm.x_proj.weight, config.ssm_intermediate_size),
    ):
        bound = 1 / math.sqrt(fan_in)
        assert weight.abs().max() <= bound and weight.std() > 0.5 * bound
    assert torch.count_nonzero(ssm.conv1d.bias) == 0
    # Log-uniform: the median sits near the geometric mean of the range.
    assert abs(math.log(dt.median().item()) - math.log(math.sqrt(0.002 * 0.05))) < 0.8


def test_fresh_model_equals_its_attention_only_control():
    """With out_proj at zero, the SSM branch adds nothing: upcycling an attention checkpoint is safe."""
    torch.manual_seed(0)
    hybrid = HybridForCausalLM(tiny_config()).eval()
    control = HybridForCausalLM(tiny_config(use_ssm_branch=False)).eval()
    missing, unexpected = control.load_state_dict(hybrid.state_dict(), strict=False)
    assert not missing and all(".ssm." in name for name in unexpected)
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hybrid(ids).logits, control(ids).logits)


@pytest.mark.parametrize("lengths", [(4, 2), (19, 12)], ids=["inside-the-window", "beyond-the-window"])
def test_static_cache_generates_what_the_dynamic_cache_generates(make_model, lengths):
    """`cache_implementation="static"` (HybridStaticCache: window buffers of W slots and a full buffer sized for the
    call) gives the HybridCache's tokens and scores, left padding included, whether the prompts fit in the window
    (6) or not."""
    model = make_model()
    ids, mask = left_pad([torch.randint(3, 97, (n,)) for n in lengths], model.config.pad_token_id)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, output_scores=True)
    with torch.no_grad():
        dynamic = model.generate(ids, return_dict_in_generate=True, **kwargs)
        static = model.generate(ids, return_dict_in_generate=True, cache_implementation="static", **kwargs)
    assert isinstance(static.past_key_values, HybridStaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), atol=ATOL, rtol=1e-4)


def test_static_cache_updates_in_place_and_follows_the_one_pass_forward(make_model):
    """Step by step on a HybridStaticCache: every buffer (window KV, full KV, conv history, SSM state) keeps its
    address from the prefill on, as CUDA graphs need, and each step's logits are those of one forward over the whole
    sequence without a cache."""
    model = make_model()
    ids, mask = left_pad([torch.randint(3, 97, (n,)) for n in (9, 5)], model.config.pad_token_id)
    steps = torch.randint(3, 97, (2, 8))
    cache = HybridStaticCache(model.config, max_cache_len=ids.shape[1] + steps.shape[1])

    def addresses():
        return [
            tensor.data_ptr()
            for layer in cache.layers
            for tensor in (layer.keys, layer.values, layer.conv_states[0], layer.recurrent_states[0])
        ]

    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        after_prefill = addresses()
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step = model(steps[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
            full = torch.cat([ids, steps[:, : t + 1]], dim=1)
            reference = model(full, attention_mask=mask)
            torch.testing.assert_close(step.logits[:, -1], reference.logits[:, -1], atol=ATOL, rtol=1e-4)
    assert addresses() == after_prefill


def test_static_generation_keeps_its_largest_cache_across_calls(make_model):
    """As Transformers sizes its StaticCache: a shorter call after a longer one gets buffers of the longer call's size
    (the compiled step keeps its shapes), and generates the longer call's first tokens."""
    model = make_model()
    ids = torch.randint(3, 97, (2, 5))
    kwargs = dict(do_sample=False, pad_token_id=0, cache_implementation="static", return_dict_in_generate=True)
    with torch.no_grad():
        long = model.generate(ids, max_new_tokens=9, **kwargs)
        short = model.generate(ids, max_new_tokens=3, **kwargs)
    full_layer = model.config.layer_types.index("full_attention")
    sizes = [out.past_key_values.layers[full_layer].keys.shape[2] for out in (long, short)]
    assert sizes[0] >= ids.shape[1] + 8 and sizes[1] == sizes[0]
    assert torch.equal(short.sequences, long.sequences[:, : ids.shape[1] + 3])


@pytest.mark.parametrize("implementation", ["offloaded", "quantized", "sliding_window"])
def test_other_cache_implementations_are_refused_by_name(make_model, implementation):
    model = make_model()
    with pytest.raises(ValueError, match=f"cache_implementation={implementation!r} is not supported"):
        model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, cache_implementation=implementation)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "flex_attention"])
def test_attention_implementations_agree_with_eager(make_model, attn_implementation):
    one_cpu_thread_for(attn_implementation)
    model = make_model()
    ids, mask = left_pad([torch.randint(3, 97, (n,)) for n in (29, 13)], model.config.pad_token_id)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(attn_implementation)
        logits = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], reference[real], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flex_attention"])
def test_a_narrower_attention_window_is_the_model_with_that_window(make_model, attn_implementation, tmp_path):
    """`set_attention_window(w)` computes what the same weights compute with `sliding_window=w` (the full-attention
    layer unchanged), in training and with padding; None restores the config's window, which is what is saved."""
    one_cpu_thread_for(attn_implementation)
    model = make_model(attn_implementation=attn_implementation, sliding_window=8)
    narrow = make_model(attn_implementation=attn_implementation, sliding_window=3)
    narrow.load_state_dict(model.state_dict())
    ids, mask = left_pad([torch.randint(3, 97, (n,)) for n in (21, 14)], model.config.pad_token_id)
    real = mask.bool()
    with torch.no_grad():
        wide_logits = model(ids, attention_mask=mask).logits
        model.set_attention_window(3)
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits[real],
            narrow(ids, attention_mask=mask).logits[real],
            atol=ATOL,
            rtol=1e-4,
        )
        assert (model(ids, attention_mask=mask).logits - wide_logits)[real].abs().max() > 1e-3  # the window mattered
        if attn_implementation != "flex_attention":  # flex trains on the GPU: its CPU build of this graph fails
            model.train()
            narrow.train()
            losses = [m(ids[:1, -21:], labels=ids[:1, -21:]).loss for m in (model, narrow)]  # a training forward
            torch.testing.assert_close(losses[0], losses[1], atol=ATOL, rtol=1e-4)
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).sliding_window == 8
    model.eval()
    model.set_attention_window(None)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, wide_logits)


def test_the_attention_window_is_checked(make_model):
    model = make_model(sliding_window=8)
    for window in (0, 9, 2.5, True):
        with pytest.raises(ValueError, match="set_attention_window takes a window in"):
            model.set_attention_window(window)
    assert model.model.attention_window is None
    with pytest.raises(ValueError, match="no sliding-window layer"):
        make_model(layer_types=["full_attention"] * 3).set_attention_window(4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_normalize_heads_against_a_float64_loop(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4 * 8, generator=generator, dtype=torch.float64) * torch.tensor(
        [0.1, 1.0, 30.0, 1e-3]
    ).repeat_interleave(8)
    expected = torch.empty_like(x)
    for head in range(4):
        part = x[..., head * 8 : (head + 1) * 8]
        expected[..., head * 8 : (head + 1) * 8] = part / torch.sqrt(part.square().mean(-1, keepdim=True) + 1e-6)
    normalized = rms_normalize_heads(x.to(dtype), 8, 1e-6)
    assert normalized.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(normalized.double(), expected, atol=tol, rtol=tol)


def test_branch_norm_makes_each_branch_scale_free_and_weighs_them(make_model):
    """With ssm_branch_norm each branch is normalised per head before the sum: scaling the SSM's out_proj or the
    attention's v_proj by a positive constant leaves the logits as they were (without it, it does not), and the
    learnable scales weigh the two branches. (A tiny epsilon: the norm's own, 1e-6, is not negligible against the
    small activations of this tiny model.)"""
    input_ids = torch.randint(3, 97, (2, 15), generator=torch.Generator().manual_seed(1))
    for branch_norm in (True, False):
        model = make_model(ssm_branch_norm=branch_norm, rms_norm_eps=1e-12)
        with torch.no_grad():
            reference = model(input_ids).logits
            for layer in model.model.layers:
                layer.self_attn.ssm.out_proj.weight.mul_(3.0)
                layer.self_attn.v_proj.weight.mul_(0.25)
            scaled = model(input_ids).logits
        if branch_norm:
            torch.testing.assert_close(scaled, reference, atol=1e-5, rtol=1e-5)
        else:
            assert (scaled - reference).abs().max() > 1e-2
    model = make_model(ssm_branch_norm=True)
    with torch.no_grad():
        reference = model(input_ids).logits
        model.model.layers[0].self_attn.ssm_branch_scale.mul_(2.0)
        assert (model(input_ids).logits - reference).abs().max() > 1e-2
    fresh = HybridForCausalLM(tiny_config(ssm_branch_norm=True))
    assert all(
        layer.self_attn.attn_branch_scale.item() == layer.self_attn.ssm_branch_scale.item() == 1.0
        for layer in fresh.model.layers
    ), "the branch scales start at 1"


def test_branch_norm_without_the_branch_normalises_the_attention_alone(make_model):
    """The sliding-window control of ssm_branch_norm (use_ssm_branch=False): the attention's output normalised per head
    and scaled, nothing else. Scaling v_proj leaves the logits as they were (without the option it does not), the
    one scale weighs the attention, and there is no SSM scale to train."""
    input_ids = torch.randint(3, 97, (2, 15), generator=torch.Generator().manual_seed(2))
    for branch_norm in (True, False):
        model = make_model(use_ssm_branch=False, ssm_branch_norm=branch_norm, rms_norm_eps=1e-12)
        with torch.no_grad():
            reference = model(input_ids).logits
            for layer in model.model.layers:
                layer.self_attn.v_proj.weight.mul_(0.25)
            scaled = model(input_ids).logits
        if branch_norm:
            torch.testing.assert_close(scaled, reference, atol=1e-5, rtol=1e-5)
            attention = model.model.layers[0].self_attn
            assert attention.no_weight_decay == ("attn_branch_scale",) and not hasattr(attention, "ssm_branch_scale")
            with torch.no_grad():
                attention.attn_branch_scale.mul_(2.0)
                assert (model(input_ids).logits - reference).abs().max() > 1e-2
        else:
            assert (scaled - reference).abs().max() > 1e-2


def first_branch_and_inputs(ssm_type: str, cached: bool, seed: int):
    """A tiny model of `ssm_type`, its first layer's branch with a random out_proj (a fresh one is zero), prompt ids
    [2, 7] to build a cache from, and the branch's input [2, T, hidden] and an attention output [2, T, H * D] (T 1
    for a decode step when `cached`, else 7)."""
    config = tiny_config(**(MAMBA2_BRANCH if ssm_type == "mamba2" else {}))
    model = HybridForCausalLM(config).eval()
    branch = model.model.layers[0].self_attn.ssm
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        branch.out_proj.weight.copy_(torch.randn(branch.out_proj.weight.shape, generator=generator) * 0.1)
    ids = torch.randint(3, 97, (2, 7), generator=generator)
    hidden = torch.randn(2, 1 if cached else 7, config.hidden_size, generator=generator)
    attention = torch.randn(2, hidden.shape[1], config.num_attention_heads * config.head_dim, generator=generator)
    return model, branch, ids, hidden, attention


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
@pytest.mark.parametrize("cached", [False, True], ids=["sequence", "decode-step"])
def test_the_branch_adds_its_output_to_the_attention_in_its_out_proj_gemm(ssm_type, cached):
    """HybridAttention hands its attention output to the branch (`add_to`), whose out_proj adds it in its own GEMM
    (addmm): no add op of its own, so one launch a layer fewer and one node fewer in a compiled decode step. The sum
    is attention + s, s as the branch returns it alone; with a hook on out_proj (an adapter's path) the module is
    called and what the hook returns is added."""
    model, branch, ids, hidden, attention = first_branch_and_inputs(ssm_type, cached, seed=4)

    def run(add_to):
        """The branch's output for `hidden`, from a fresh cache of `ids` when `cached` (its state is updated)."""
        cache = model(ids, use_cache=True).past_key_values if cached else None
        with DispatchedOps() as counter:
            output = branch(hidden, cache, add_to=add_to)
        return output, counter.ops

    with torch.no_grad():
        alone, alone_ops = run(None)
        summed, summed_ops = run(attention)
        torch.testing.assert_close(summed, attention + alone, atol=1e-6, rtol=1e-5)
        assert summed_ops["add"] == alone_ops["add"], (alone_ops, summed_ops)
        assert summed_ops["addmm"] == alone_ops["addmm"] + 1

        branch.out_proj.register_forward_hook(lambda _module, _inputs, output: 2 * output)
        hooked, _ = run(attention)
        torch.testing.assert_close(hooked, attention + 2 * alone, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
@pytest.mark.parametrize("cached", [False, True], ids=["sequence", "decode-step"])
def test_a_global_module_hook_sends_the_branch_through_its_modules(ssm_type, cached):
    """A hook registered for every module (`torch.nn.modules.module.register_module_forward_hook`, as profilers and
    debuggers set) must see the branch's projections called, as it sees every other module: with one set, the branch
    neither reads their weights into its fused op nor folds out_proj into an addmm, and what the hook returns is what
    the branch uses."""
    model, branch, ids, hidden, attention = first_branch_and_inputs(ssm_type, cached, seed=5)

    def run():
        cache = model(ids, use_cache=True).past_key_values if cached else None
        return branch(hidden, cache, add_to=attention)

    called = []

    def doubling_out_proj(module, _inputs, output):
        called.append(module)
        return 2 * output if module is branch.out_proj else output

    with torch.no_grad():
        plain = run()
        alone = plain - attention
        handle = torch.nn.modules.module.register_module_forward_hook(doubling_out_proj)
        try:
            hooked = run()
        finally:
            handle.remove()
    projections = [module for module in branch.children() if isinstance(module, torch.nn.Linear)]
    assert projections and all(any(m is module for m in called) for module in projections), [
        type(m).__name__ for m in called
    ]
    torch.testing.assert_close(hooked, attention + 2 * alone, atol=1e-5, rtol=1e-4)
