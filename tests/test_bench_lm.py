"""The LM benchmark (tools/lm_benchmark/, CLI scripts/bench_lm.py): the corpus, the evaluation functions against
naive references, the pipeline (--smoke)."""

import json
import re
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerFast

from configuration import HybridConfig
from modeling import HybridForCausalLM
from tools.lm_benchmark import cli
from tools.lm_benchmark.corpus import collect_corpus, python_source_roots
from tools.lm_benchmark.evaluation import (
    PASSKEY_ALPHABET,
    RETRIEVAL_FORMATS,
    context_gain,
    continuation_logprob,
    evaluation_sequences,
    loss_by_position,
    loss_with_short_context,
    loss_with_ssm_reset,
    passkey_accuracy,
    passkey_probes,
    previous_bigram_distance,
    repeated_bigram_loss,
    retrieval_probes,
    retrieval_score,
    token_losses,
)
from tools.lm_benchmark.models import SMOKE_SHAPE, Shape, build_model
from tools.lm_benchmark.retrieval_data import TRAINING_FORMATS, WithSyntheticRetrievals, training_format_probes
from tools.lm_benchmark.tokens import PackedSequences
from tools.lm_benchmark.tokens import EOS, encode_files, train_tokenizer


def tiny_model(use_ssm_branch: bool, num_hidden_layers: int = 1, window: int = 8) -> HybridForCausalLM:
    torch.manual_seed(0)
    config = HybridConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        use_ssm_branch=use_ssm_branch,
        ssm_dt_min=0.01,
        ssm_dt_max=0.1,
    )
    model = HybridForCausalLM(config).eval()
    if use_ssm_branch:
        # A live branch: out_proj starts at zero and the rest small, which would hide the history it carries.
        for layer in model.model.layers:
            for weight in (
                layer.self_attn.ssm.in_proj.weight,
                layer.self_attn.ssm.x_proj.weight,
                layer.self_attn.ssm.out_proj.weight,
            ):
                torch.nn.init.normal_(weight, std=0.3)
    return model


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def source(i: int) -> bytes:
    """A small Python file, the same size for every i."""
    return f"def function_{i:03}(x):\n    return x * {i:03} + {i * i:05}\n\n".encode() * 8


def test_corpus_is_deterministic_deduplicated_and_split_by_file(tmp_path):
    root = tmp_path / "root"
    for i in range(40):
        write(root / f"pkg{i % 3}" / f"m{i}.py", source(i))
    write(root / "pkg0" / "copy_of_m1.py", source(1))  # same content as pkg1/m1.py
    write(root / "latin1.py", "x = 'caf\xe9'\n".encode("latin-1") * 40)  # not UTF-8
    write(root / "tiny.py", b"x = 1\n")  # under the size floor
    write(root / "huge.py", b"# " + b"y" * 5000 + b"\n")  # over the cap given below
    write(root / "__pycache__" / "cached.py", source(99))
    write(root / "notes.txt", source(98))
    (root / "link.py").symlink_to(root / "pkg0" / "m0.py")

    def collect():
        return collect_corpus([("lib", root)], min_file_bytes=64, max_file_bytes=4096, validation_fraction=0.25)

    corpus = collect()
    texts = corpus.train + corpus.validation
    assert sorted(texts) == sorted(source(i).decode() for i in range(40))  # one copy of m1, nothing skipped wrongly
    assert corpus.validation and corpus.train and not set(corpus.train) & set(corpus.validation)
    assert corpus.stats["skipped"] == {"duplicate": 1, "not_utf8": 1}
    assert (corpus.stats["train_files"], corpus.stats["validation_files"]) == (
        len(corpus.train),
        len(corpus.validation),
    )
    assert corpus.stats["train_bytes"] == sum(len(t) for t in corpus.train)

    again = collect()
    assert again.stats["list_sha256"] == corpus.stats["list_sha256"] and again.train == corpus.train

    # A new file leaves every other file on its side of the split; changed content changes the list's hash.
    write(root / "pkg2" / "new.py", source(41))
    grown = collect()
    assert set(corpus.validation) <= set(grown.validation) and set(corpus.train) <= set(grown.train)
    write(root / "pkg0" / "m0.py", source(0) + b"# edited\n")
    assert collect().stats["list_sha256"] != grown.stats["list_sha256"]


def test_corpus_budget_takes_a_spread_sample(tmp_path):
    root = tmp_path / "root"
    for i in range(30):
        write(root / f"m{i:02}.py", source(i))
    size = len(source(0))
    corpus = collect_corpus([("lib", root)], max_total_bytes=10 * size + size // 2, validation_fraction=0)
    assert len(corpus.train) == 10
    names = sorted(int(t.split("function_")[1].split("(")[0]) for t in corpus.train)
    assert names != list(range(10))  # not simply the first files of the walk


def test_each_file_is_walked_once_and_the_stdlib_without_its_site_packages(tmp_path):
    stdlib, packages = tmp_path / "lib", tmp_path / "lib" / "venv-packages"
    write(stdlib / "os_like.py", source(1))
    write(stdlib / "site-packages" / "base_interpreter_package.py", source(2))
    write(packages / "torch_like.py", source(3))
    corpus = collect_corpus([("stdlib", stdlib), ("site", packages)], validation_fraction=0)
    assert sorted(corpus.train) == [source(1).decode(), source(3).decode()]
    assert corpus.stats["skipped"]["duplicate"] == 0  # the nested root was not walked twice

    roots = dict(python_source_roots())
    assert roots["stdlib"] == Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert roots["site"] == Path(sysconfig.get_paths()["purelib"]).resolve()


def test_loss_by_position_matches_the_models_loss_and_a_naive_loop():
    model = tiny_model(use_ssm_branch=True)
    sequences = torch.randint(0, 97, (5, 33), generator=torch.Generator().manual_seed(1))
    losses = loss_by_position(model, sequences, batch_size=2)
    assert losses.shape == (32,)
    with torch.no_grad():
        assert losses.mean() == pytest.approx(model(input_ids=sequences, labels=sequences).loss.item(), abs=1e-5)
        for t in (0, 7, 31):
            naive = np.mean(
                [
                    F.cross_entropy(
                        model(input_ids=sequences[s : s + 1, : t + 1]).logits[0, -1], sequences[s, t + 1]
                    ).item()
                    for s in range(5)
                ]
            )
            assert losses[t] == pytest.approx(naive, abs=1e-5)


def test_short_context_loss_sees_at_most_2w_tokens():
    window = 8
    sequences = torch.randint(0, 97, (3, 61), generator=torch.Generator().manual_seed(2))
    hybrid = tiny_model(use_ssm_branch=True, window=window)
    short = loss_with_short_context(hybrid, sequences, window, batch_size=2)
    assert np.isnan(short[: 2 * window]).all() and not np.isnan(short[2 * window :]).any()
    with torch.no_grad():
        for t in (16, 23, 24, 40, 59):
            first = (t // window - 1) * window  # the context starts at (k-1)W for kW <= t < (k+1)W
            logits = hybrid(input_ids=sequences[:, first : t + 1]).logits[:, -1]
            assert short[t] == pytest.approx(F.cross_entropy(logits, sequences[:, t + 1]).item(), abs=1e-5)
    whole = loss_by_position(hybrid, sequences, batch_size=2)
    assert np.abs(whole - short)[2 * window :].max() > 1e-3  # the SSM state carries what is older than 2W

    # One sliding layer sees W tokens and no more: cutting the context to >= W tokens changes nothing.
    swa = tiny_model(use_ssm_branch=False, window=window)
    whole, short = (
        f(swa, sequences, *args) for f, args in ((loss_by_position, (2,)), (loss_with_short_context, (window, 2)))
    )
    np.testing.assert_allclose(short[2 * window :], whole[2 * window :], atol=1e-5)


def test_ssm_reset_loss_restarts_the_branch_alone_between_d_and_2d_tokens_back():
    """The prediction from t carries in the SSM only tokens b..t, b = (t // D - 1) * D, and in the attention its
    whole window: against a naive loop that restarts the branch at b on each prefix alone (exact for one layer; deeper,
    the attention also reads earlier positions' branches, which the two passes restart on their own grid)."""
    history, window = 6, 8
    sequences = torch.randint(0, 97, (3, 41), generator=torch.Generator().manual_seed(3))
    hybrid = tiny_model(use_ssm_branch=True, num_hidden_layers=1, window=window)
    reset = loss_with_ssm_reset(hybrid, sequences, history, batch_size=2)
    assert np.isnan(reset[:history]).all() and not np.isnan(reset[history:]).any()
    with torch.no_grad():
        for t in range(history, 40):
            b = (t // history - 1) * history
            seq_idx = (torch.arange(t + 1) >= b).long().expand(3, -1).contiguous()
            logits = hybrid(input_ids=sequences[:, : t + 1], seq_idx=seq_idx).logits[:, -1]
            assert reset[t] == pytest.approx(F.cross_entropy(logits, sequences[:, t + 1]).item(), abs=1e-5), t
    whole = loss_by_position(hybrid, sequences, batch_size=2)
    assert np.abs(whole - reset)[2 * history :].max() > 1e-3  # the branch carries what is older than D

    # With the branches' output at zero the attention alone predicts: the restarts change nothing (they never cut it).
    hybrid = tiny_model(use_ssm_branch=True, num_hidden_layers=2, window=window)
    for layer in hybrid.model.layers:
        torch.nn.init.zeros_(layer.self_attn.ssm.out_proj.weight)
    np.testing.assert_allclose(
        loss_with_ssm_reset(hybrid, sequences, history, 2)[history:],
        loss_by_position(hybrid, sequences, 2)[history:],
        atol=1e-5,
    )


def test_context_gain_per_bucket():
    shape = Shape(window=4, context=64)
    whole = np.linspace(3.0, 2.0, 63)
    short = whole + np.where(np.arange(63) >= 16, 0.5, 0.0)
    short[:8] = np.nan
    gains = context_gain(whole, short, shape)
    assert list(gains) == ["[2W,4W)", "[4W,16W)"]
    assert gains["[2W,4W)"]["whole_file"] == pytest.approx(whole[8:16].mean(), abs=1e-4)
    assert gains["[2W,4W)"]["gain"] == pytest.approx(0.0, abs=1e-4)
    assert gains["[4W,16W)"]["gain"] == pytest.approx(0.5, abs=1e-4)


def test_evaluation_sequences_start_like_training_files():
    files = [np.arange(3, 3 + n, dtype=np.uint16) for n in (5, 20, 9, 30)]
    sequences = evaluation_sequences(files, context=10, limit=2, eos_token_id=0)
    assert sequences.tolist() == [[0, *range(3, 12)], [0, *range(3, 12)]]


@pytest.fixture(scope="module")
def code_tokenizer_and_files():
    texts = [path.read_text() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:12]]
    tokenizer = train_tokenizer(texts, vocab_size=400)
    return tokenizer, encode_files(tokenizer, texts)


class OracleModel(torch.nn.Module):
    """Predicts, with certainty, the continuation recorded for each probe it knows (its answer shifted by `offset`)."""

    def __init__(self, probes, vocab_size, offset=0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(pad_token_id=0)
        self.continuations = {
            tuple(p.input_ids): p.input_ids[1:] + [(p.answer[-1] + offset) % vocab_size] for p in probes
        }
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for row in range(len(input_ids)):
            start = int((attention_mask[row] == 0).sum())
            continuation = self.continuations[tuple(input_ids[row, start:].tolist())]
            logits[row, start:] = F.one_hot(torch.tensor(continuation), self.vocab_size).float()
        return SimpleNamespace(logits=logits)


def test_passkey_probes_and_their_scoring(code_tokenizer_and_files):
    tokenizer, files = code_tokenizer_and_files
    probes = passkey_probes(tokenizer, files, distance=100, count=12, seed=0)
    question = tokenizer.encode('\nassert passkey == "', add_special_tokens=False)
    for probe in probes:
        value = tokenizer.decode(probe.answer)
        assert len(value) == 5 and set(value) <= set(PASSKEY_ALPHABET)
        assignment = tokenizer.encode(f'passkey = "{value}"\n', add_special_tokens=False)
        assert probe.input_ids[: len(assignment)] == assignment
        filler = probe.input_ids[len(assignment) : -len(question) - len(probe.answer) + 1]
        assert len(filler) == 100
        assert probe.input_ids[len(assignment) + 100 :] == question + probe.answer[:-1]
    assert len({tuple(p.answer) for p in probes}) > 10  # random values

    vocab = len(tokenizer)
    assert passkey_accuracy(OracleModel(probes, vocab), probes, batch_size=5) == 1.0
    assert passkey_accuracy(OracleModel(probes, vocab, offset=1), probes, batch_size=5) == 0.0
    half = OracleModel(probes[:6], vocab)
    half.continuations.update(OracleModel(probes[6:], vocab, offset=1).continuations)
    assert passkey_accuracy(half, probes, batch_size=4) == 0.5


def test_previous_bigram_distance_against_a_naive_search():
    sequences = torch.randint(0, 4, (3, 50), generator=torch.Generator().manual_seed(4))
    distance = previous_bigram_distance(sequences)
    assert distance.shape == (3, 49)
    for row in range(3):
        ids = sequences[row].tolist()
        for t in range(49):
            earlier = [j for j in range(t) if (ids[j], ids[j + 1]) == (ids[t], ids[t + 1])]
            assert distance[row, t] == (t - earlier[-1] if earlier else 0)


def test_repeated_bigram_loss_classes():
    window = 4
    # Row: a bigram (7, 8) at 0, again at 9 (9 back: W..4W) and 11 (2 back: within W); the rest distinct pairs.
    ids = [7, 8] + list(range(20, 27)) + [7, 8, 7, 8] + list(range(30, 50))
    sequences = torch.tensor([ids])
    losses = np.arange(sequences.shape[1] - 1, dtype=np.float32)[None] / 10
    classes = repeated_bigram_loss(sequences, losses, window)
    # Positions >= 2W = 8: t = 9 (7->8, 9 back), t = 10 (8->7, first), t = 11 (7->8, 2 back), the rest first.
    assert classes["W..4W back"] == {"loss": 0.9, "tokens": 1}
    assert classes["within W"] == {"loss": 1.1, "tokens": 1}
    assert classes["beyond 4W"] == {"loss": None, "tokens": 0}
    first = [t for t in range(8, len(ids) - 1) if t not in (9, 11)]
    assert classes["first occurrence"]["tokens"] == len(first)
    assert classes["first occurrence"]["loss"] == pytest.approx(np.mean(first) / 10, abs=1e-4)


def test_token_losses_are_the_per_row_losses():
    model = tiny_model(use_ssm_branch=True)
    sequences = torch.randint(0, 97, (5, 21), generator=torch.Generator().manual_seed(5))
    losses = token_losses(model, sequences, batch_size=2)
    with torch.no_grad():
        for row in (0, 4):
            logits = model(input_ids=sequences[row : row + 1]).logits[0, :-1]
            expected = F.cross_entropy(logits, sequences[row, 1:], reduction="none")
            np.testing.assert_allclose(losses[row], expected.numpy(), atol=1e-5)


def test_retrieval_probes_and_their_scoring(code_tokenizer_and_files):
    tokenizer, files = code_tokenizer_and_files
    probes = retrieval_probes(tokenizer, files, distance=60, count=9, seed=0)
    for i, probe in enumerate(probes):
        assert len(probe.filler) == 60
        assignment, question = (tokenizer.decode(p) for p in (probe.assignment, probe.question))
        value = tokenizer.decode(probe.value)
        template_assignment, template_question = RETRIEVAL_FORMATS[i % 3]
        key = question.split("assert ")[1].split(" == ")[0].replace("registry[", "").strip('"[]()')
        assert assignment == template_assignment.format(key=key, value=value)
        assert question == template_question.format(key=key)
        assert value[:-2].isalpha() and value[-2:].isdigit()
    assert len({tuple(p.value) for p in probes}) == 9  # random keys and values
    assert probes == retrieval_probes(tokenizer, files, distance=60, count=9, seed=0)  # the same for every model

    # The score of each continuation against a naive forward of that probe alone (no padding).
    model = tiny_model(use_ssm_branch=True)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = 0
    prefixes = [p.assignment + p.filler + p.question for p in probes[:5]]
    prefixes[1] = prefixes[1][10:]  # rows of different lengths: left padding
    values = [p.value for p in probes[:5]]
    scores = continuation_logprob(model, prefixes, values, batch_size=3)
    with torch.no_grad():
        for prefix, value, score in zip(prefixes, values, scores):
            log_probs = model(input_ids=torch.tensor([prefix + value])).logits[0].log_softmax(-1)
            expected = np.mean([log_probs[len(prefix) - 1 + k, token].item() for k, token in enumerate(value)])
            assert score == pytest.approx(expected, abs=1e-4)
    result = retrieval_score(model, probes[:5], batch_size=3)
    assert result["retrieved"] == pytest.approx(result["logprob"] - result["logprob_without_assignment"], abs=2e-4)


def test_synthetic_retrievals_in_the_training_sequences(code_tokenizer_and_files):
    """A share of the sequences carry an assignment at a line start and, min_gap..max_gap tokens after it, the line
    that repeats its value after its key, in one of the training formats; the rest of each sequence is the stream's,
    and the other sequences are left alone."""
    tokenizer, files = code_tokenizer_and_files
    packed = PackedSequences(np.concatenate(files), 2048)
    data = WithSyntheticRetrievals(packed, tokenizer, share=0.5, min_gap=100, max_gap=200, seed=0)
    assert len(data) == len(packed)
    carried = [i for i in range(len(data)) if data.carries_retrieval(i)]
    assert 0.25 * len(data) < len(carried) < 0.75 * len(data)
    patterns = [
        tuple(re.escape(line).replace(r"\{key\}", r"(\w+)").replace(r"\{value\}", r"([\w-]+)") for line in pair)
        for pair in TRAINING_FORMATS
    ]
    for index in range(len(data)):
        item, original = data[index], packed[index]["input_ids"]
        assert item["input_ids"].shape == original.shape and torch.equal(item["labels"], item["input_ids"])
        if index not in carried:
            assert torch.equal(item["input_ids"], original)
            continue
        (start, assignment), (use_start, use) = data.placement(index, original)
        ids = item["input_ids"]
        assert ids[start : start + len(assignment)].tolist() == assignment and start > 0
        before = tokenizer.decode(original[start - 1 : start])
        assert "\n" in before and not before.rsplit("\n", 1)[1].strip()  # a newline, then only indentation
        assert ids[use_start : use_start + len(use)].tolist() == use
        assert 100 <= use_start - (start + len(assignment)) <= 200
        untouched = torch.ones_like(ids, dtype=torch.bool)
        untouched[start : start + len(assignment)] = untouched[use_start : use_start + len(use)] = False
        assert torch.equal(ids[untouched], original[untouched])
        texts = tokenizer.decode(assignment), tokenizer.decode(use)
        matches = [(re.fullmatch(a, texts[0]), re.fullmatch(u, texts[1])) for a, u in patterns]
        ((assigned, used),) = [m for m in matches if all(m)]
        key, value = assigned.groups()
        assert used.groups() == (key, value)
        assert re.fullmatch(r"[a-z]+[A-Z][a-z]+[0-9]", key) and re.fullmatch(r"[a-z]{6}-[0-9]{3}", value)
    again = WithSyntheticRetrievals(packed, tokenizer, share=0.5, min_gap=100, max_gap=200, seed=0)
    assert all(torch.equal(data[i]["input_ids"], again[i]["input_ids"]) for i in carried[:3])  # deterministic
    assert not any(WithSyntheticRetrievals(packed, tokenizer, 0.0, 100, 200).carries_retrieval(i) for i in carried)
    with pytest.raises(ValueError, match="do not fit in a training sequence"):
        WithSyntheticRetrievals(packed, tokenizer, share=1.0, min_gap=2100, max_gap=2100)[0]


def test_training_format_probes_ask_what_the_data_lever_teaches(code_tokenizer_and_files):
    """The probes of the data lever's own kind: an assignment in one of the training formats, the filler, the use line
    up to the value; keys and values of the training pairs' kind, never the evaluation probes' formats."""
    tokenizer, files = code_tokenizer_and_files
    probes = training_format_probes(tokenizer, files, distance=60, count=12, seed=0)
    patterns = [
        (re.escape(a).replace(r"\{key\}", r"(\w+)").replace(r"\{value\}", r"([\w-]+)"), u.split("{value}")[0])
        for a, u in TRAINING_FORMATS
    ]
    used_formats = set()
    for probe in probes:
        assert len(probe.filler) == 60
        assignment, question, value = (tokenizer.decode(p) for p in (probe.assignment, probe.question, probe.value))
        ((index, key),) = [(i, m.group(1)) for i, (a, _) in enumerate(patterns) if (m := re.fullmatch(a, assignment))]
        assert assignment == TRAINING_FORMATS[index][0].format(key=key, value=value)
        assert question == patterns[index][1].format(key=key)
        assert re.fullmatch(r"[a-z]+[A-Z][a-z]+[0-9]", key) and re.fullmatch(r"[a-z]{6}-[0-9]{3}", value)
        assert not any(question == q.format(key=key) for _, q in RETRIEVAL_FORMATS)
        used_formats.add(index)
    assert used_formats == set(range(len(TRAINING_FORMATS)))
    assert probes == training_format_probes(tokenizer, files, distance=60, count=12, seed=0)  # fixed for every model


MATCHED = ("hybrid", "swa", "swa-matched")


def test_swa_matched_has_the_hybrids_parameters(code_tokenizer_and_files):
    tokenizer, _ = code_tokenizer_and_files
    shape = Shape(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    counts = {kind: build_model(kind, shape, tokenizer, "sdpa", 0).num_parameters() for kind in MATCHED}
    assert counts["swa"] < counts["hybrid"]
    per_64_columns = 3 * 64 * shape.hidden_size * shape.num_hidden_layers
    assert abs(counts["swa-matched"] - counts["hybrid"]) <= per_64_columns / 2
    hybrid = build_model("hybrid", SMOKE_SHAPE, tokenizer, "sdpa", 0, {"ssm_dt_min": 1e-4})
    assert hybrid.config.ssm_dt_min == 1e-4
    # the branch normalisation reaches the sliding-window baselines too, as their control: their attention alone
    lever = {"ssm_branch_norm": True}
    for kind in MATCHED:
        attention = build_model(kind, SMOKE_SHAPE, tokenizer, "sdpa", 0, lever).model.layers[0].self_attn
        assert attention.config.ssm_branch_norm and hasattr(attention, "attn_branch_scale")
        assert hasattr(attention, "ssm_branch_scale") == (kind == "hybrid")


def test_bad_arguments_are_refused(capsys):
    for argv, message in (
        (["--models", "hybrid,bogus", "--steps", "3"], "bogus"),
        (["--models", "swa"], "--steps or --train-seconds"),
        (["--steps", "0"], "positive"),
        (["--steps", "3", "--set", "ssm_dt_mn=1e-4"], "HybridConfig field"),
        (["--steps", "3", "--set", "ssm_dt_min"], "FIELD=VALUE"),
        (["--steps", "3", "--set", "sliding_window=-3"], "--set"),
        # the model kind's field, not a lever (it reached HybridConfig twice: a TypeError after the corpus was built)
        (["--steps", "3", "--set", "use_ssm_branch=false"], "the model kind sets it"),
        # checked at the run's shape (the smoke hybrid's E is 64), not the default config's
        (["--smoke", "--set", "ssm_type=mamba2", "--set", "ssm_head_dim=128"], "ssm_head_dim (128) must divide"),
        (["--report", "no-such-results.json"], "--report: no such file: no-such-results.json"),
        (["--steps", "3", "--retrieval-data-share", "1.5"], "--retrieval-data-share"),
    ):
        with pytest.raises(SystemExit) as error:
            cli.parse_args(argv)
        assert error.value.code == 2 and message in capsys.readouterr().err


def test_smoke_runs_the_pipeline_and_reports_the_three_models(tmp_path, capsys):
    torch.set_num_threads(1)
    assert cli.main(["--smoke", "--output-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "loss" not in line]
    assert rows[:3] == ["hybrid", "swa", "full"]

    results = {m: json.loads((tmp_path / f"results-{m}.json").read_text()) for m in ("hybrid", "swa", "full")}
    assert len({r["train"]["tokens"] for r in results.values()}) == 1  # the same tokens for each model
    assert len({r["corpus"]["list_sha256"] for r in results.values()}) == 1
    for model, result in results.items():
        evaluation = result["eval"]
        assert 0 < evaluation["mean_loss"] < np.log(result["shape"]["vocab_size"]) + 1
        assert list(evaluation["loss_by_bucket"]) == ["[0,W)", "[W,4W)", "[4W,16W)"]
        assert len(evaluation["passkey"]) == 5 and all(0 <= a <= 1 for a in evaluation["passkey"].values())
        assert list(evaluation["context_beyond_2W"]) == ["[2W,4W)", "[4W,16W)"]
        assert result["train"]["tokens_per_second"] > 0
        assert (evaluation["ssm_memory"] is not None) == (model == "hybrid")
        # W 16, T 128: the branch restarted W and 2W back (4W leaves no position >= 8W inside T).
        assert list(evaluation["ssm_beyond_reset"]) == (["1W", "2W"] if model == "hybrid" else [])
        bigrams = evaluation["repeated_bigrams"]
        assert list(bigrams) == ["within W", "W..4W back", "beyond 4W", "first occurrence"]
        assert sum(c["tokens"] for c in bigrams.values()) == 16 * (128 - 1 - 2 * 16)  # every position >= 2W once
        assert [k.split(" ")[0] for k in evaluation["retrieval"]] == ["0.5W", "1W", "2W", "4W", "8W", "16W"]
        for score in evaluation["retrieval"].values():
            assert score["logprob"] < 0 and score["logprob_without_assignment"] < 0
    assert results["hybrid"]["parameters"] > results["swa"]["parameters"] == results["full"]["parameters"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "data" / "tokenizer")
    # EOS separates the files and must train: the padding token (whose embedding stays zero) is another one.
    assert tokenizer.eos_token == EOS and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert {r["corpus"]["tokenizer_vocab_size"] for r in results.values()} == {len(tokenizer)}

    plot, decision_plot = tmp_path / "lm.png", tmp_path / "decision.png"
    paths = [str(tmp_path / f"results-{m}.json") for m in results]
    assert cli.main(["--report", *paths, "--plot", str(plot), "--decision-plot", str(decision_plot)]) == 0
    report = capsys.readouterr().out.replace(f"plot: {plot}\n", "").replace(f"plot: {decision_plot}\n", "")
    assert table.rstrip().endswith(report.rstrip())  # the run's own tables, again from its JSON
    assert plot.read_bytes()[:8] == decision_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_runs_a_lever_study(tmp_path, capsys):
    """The levers reach the run and its record: config fields (`--set`), the stochastic window, the synthetic
    retrievals; `--tag` names the results."""
    torch.set_num_threads(1)
    argv = ["--smoke", "--steps", "4", "--output-dir", str(tmp_path), "--models", "hybrid", "--tag", "levers"]
    argv += ["--set", "ssm_dt_min=0.0001", "--set", "ssm_branch_norm=true", "--short-window", "4"]
    argv += ["--retrieval-data-share", "1.0"]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "results-hybrid-levers.json").read_text())
    assert result["config_overrides"] == {"ssm_dt_min": 0.0001, "ssm_branch_norm": True} and result["tag"] == "levers"
    assert result["short_window"] == {"window": 4, "probability": 0.5, "until": 0.85}
    assert result["retrieval_data_share"] == 1.0
    window = result["shape"]["window"]  # the trained gaps: 2W up to half the smoke shape's 8W sequence
    keys = [key.removesuffix(" >T") for key in result["eval"]["retrieval_training_formats"]]  # >T: past the context
    assert keys == [f"2W ({2 * window})", f"4W ({4 * window})"]
    for score in result["eval"]["retrieval_training_formats"].values():
        assert score["retrieved"] == pytest.approx(score["logprob"] - score["logprob_without_assignment"], abs=2e-4)
    assert "| hybrid [levers] |" in capsys.readouterr().out


def test_a_run_split_into_train_and_evaluate_stages_gives_the_one_process_results(tmp_path, capsys):
    """`--stage train` saves the trained model and its training record, `--stage evaluate` loads them: the evaluation
    and the training record are those of the same run in one process. The evaluation refuses other settings than the
    training's, a model that was not trained, and models made from a teacher."""
    torch.set_num_threads(1)
    run = ["--smoke", "--steps", "4", "--models", "hybrid", "--seed", "1", "--set", "ssm_dt_min=0.0001"]
    assert cli.main([*run, "--output-dir", str(tmp_path / "one")]) == 0
    staged = [*run, "--output-dir", str(tmp_path / "two"), "--tag", "staged"]
    assert cli.main([*staged, "--stage", "train"]) == 0
    assert not list((tmp_path / "two").glob("results-*.json"))
    for other in (["--seed", "2"], ["--corpus-bytes", str(3 << 20)]):  # another model, other data
        with pytest.raises(SystemExit) as error:
            cli.main([*staged, "--stage", "evaluate", *other])
        assert error.value.code == 2 and "the arguments of --stage train" in capsys.readouterr().err
    assert cli.main([*staged, "--stage", "evaluate"]) == 0
    one = json.loads((tmp_path / "one" / "results-hybrid.json").read_text())
    two = json.loads((tmp_path / "two" / "results-hybrid-staged.json").read_text())
    timings = one["eval"].pop("seconds"), two["eval"].pop("seconds")
    assert two["eval"] == one["eval"]
    parts = ["loss by position", "short context", "SSM reset", "passkey", "retrieval", "SSM memory"]
    assert list(timings[0]) == list(timings[1]) == parts  # each part's seconds, for the log and the record
    assert two["train"]["loss_log"] == one["train"]["loss_log"] and two["train"]["tokens"] == one["train"]["tokens"]
    assert two["train"]["settings"]["seed"] == 1 and "command" in two["train"]  # the training's own record
    assert (two["config_overrides"], two["seed"], two["parameters"]) == (one["config_overrides"], 1, one["parameters"])

    for argv, message in (
        ([*staged, "--stage", "evaluate", "--models", "swa"], "no trained model"),
        (["--models", "full,distilled", "--steps", "3", "--stage", "train"], "not distilled"),
    ):
        with pytest.raises(SystemExit) as error:
            cli.parse_args(argv)
        assert error.value.code == 2 and message in capsys.readouterr().err


def test_smoke_upcycles_the_trained_full_model_and_distils_it(tmp_path, capsys):
    """`full`, then what starts from it: the upcycled model computes `full`'s function inside the window (its loss
    there is the teacher's), and both distillations train from it with the teacher's KL as their loss."""
    torch.set_num_threads(1)
    models = ["full", "upcycled", "distilled", "distilled-swa"]
    assert cli.main(["--smoke", "--output-dir", str(tmp_path), "--models", ",".join(models)]) == 0
    results = {m: json.loads((tmp_path / f"results-{m}.json").read_text()) for m in models}
    full, upcycled = results["full"]["eval"], results["upcycled"]["eval"]
    window = results["full"]["shape"]["window"]
    inside = [(x, y) for x, y in full["loss_curve"] if x < window]
    assert inside and inside == [(x, y) for x, y in upcycled["loss_curve"] if x < window]
    assert upcycled["loss_by_bucket"]["[0,W)"] == full["loss_by_bucket"]["[0,W)"]
    assert results["upcycled"]["train"]["steps"] == 0
    for student in ("distilled", "distilled-swa"):
        assert results[student]["distillation"]["teacher"] == str(tmp_path / "full" / "checkpoint")
        assert results[student]["train"]["tokens"] == results["full"]["train"]["tokens"]
    assert results["distilled"]["parameters"] == results["upcycled"]["parameters"]
    assert results["distilled-swa"]["parameters"] == results["full"]["parameters"]
    assert "share of the gap upcycled -> full" in capsys.readouterr().out


def test_models_from_the_teacher_need_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        cli.parse_args(["--models", "distilled", "--steps", "3", "--output-dir", str(tmp_path)])
    assert error.value.code == 2 and "starts from a trained full" in capsys.readouterr().err
