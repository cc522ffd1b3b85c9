"""GLUE fine-tuning (issue 21, "Fine-tuning"): the metrics against scikit-learn / scipy, RoBERTa's input
format and head, the padding mask, a separable task learnt to > 95%, real RTE data end to end from a
tiny masked-LM checkpoint, and the refusal of a causal-LM checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn import metrics as skm

from megaformer.checkpoint.reshard import split, write_module_checkpoint
from megaformer.config.load import to_dict
from megaformer.config.schema import ConfigError, ModelConfig, RunConfig
from megaformer.data import glue
from megaformer.data.mlm import BOS_ID, EOD_ID, MLM_VOCAB_SIZE, PAD_ID
from megaformer.model import NormFormerLM, vocab_param_names
from megaformer.tools import finetune as ft

REPO = Path(__file__).resolve().parents[2]
GLUE_DIR = REPO / "data" / "glue"


def tiny_config(objective: str = "mlm", seq_len: int = 64) -> ModelConfig:
    """d 64, 2 layers, 4 heads; the masked LM's 50265-row vocabulary (GPT-2's for the causal LM)."""
    return ModelConfig(
        vocab_size=MLM_VOCAB_SIZE if objective == "mlm" else 50257,
        make_vocab_size_divisible_by=8,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        seq_len=seq_len,
        objective=objective,
        position_embedding="learned",
    )


def full_weights(config: ModelConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    """A freshly initialised model's weights as :func:`~megaformer.checkpoint.reshard.consolidate`
    returns them (vocabulary rows cut to ``vocab_size``)."""
    vocab = set(vocab_param_names(config))
    model = NormFormerLM(config, seed=seed)
    return {
        n: (p.detach()[: config.vocab_size] if n in vocab else p.detach()).clone()
        for n, p in model.named_parameters()
    }


def write_checkpoint(root: Path, config: ModelConfig) -> Path:
    """``root/checkpoints/global_step1`` in DeepSpeed's layout (TP = 1), as the trainer writes it."""
    run = to_dict(RunConfig(model=config))
    shards = split(full_weights(config), config, 1)
    write_module_checkpoint(str(root / "checkpoints"), "global_step1", shards, run, 1, None, run)
    return root / "checkpoints"


# ---- metrics: GLUE's, against the reference implementations ----


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_metrics_match_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    labels, preds = rng.integers(0, 2, 300), rng.integers(0, 2, 300)
    assert glue.accuracy(labels, preds) == pytest.approx(skm.accuracy_score(labels, preds), abs=1e-12)
    assert glue.f1_positive(labels, preds) == pytest.approx(skm.f1_score(labels, preds), abs=1e-12)
    assert glue.matthews(labels, preds) == pytest.approx(skm.matthews_corrcoef(labels, preds), abs=1e-12)
    three_l, three_p = rng.integers(0, 3, 300), rng.integers(0, 3, 300)  # MNLI's three classes
    assert glue.matthews(three_l, three_p) == pytest.approx(
        skm.matthews_corrcoef(three_l, three_p), abs=1e-12
    )


def test_degenerate_predictions_score_as_scikit_learn_does():
    labels = np.array([0, 1, 1, 0, 1])
    constant = np.zeros(5, dtype=int)
    assert glue.matthews(labels, constant) == skm.matthews_corrcoef(labels, constant) == 0.0
    assert glue.f1_positive(labels, constant) == skm.f1_score(labels, constant, zero_division=0) == 0.0
    assert math.isnan(glue.pearson(labels.astype(float), constant.astype(float)))


@pytest.mark.parametrize("seed", [0, 1])
def test_correlations_match_scipy_ties_included(seed):
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 26, 400) / 5.0  # STS-B scores on a 0.2 grid: many ties
    pred = gold + rng.normal(0, 1.0, 400)
    pred[:50] = np.round(pred[:50])  # ties on the predicted side too
    assert glue.pearson(gold, pred) == pytest.approx(stats.pearsonr(gold, pred)[0], abs=1e-12)
    assert glue.spearman(gold, pred) == pytest.approx(stats.spearmanr(gold, pred)[0], abs=1e-12)


def test_score_uses_the_argmax_and_each_task_s_metrics():
    logits = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.5], [0.2, 0.1]])  # predictions 0, 1, 0, 0
    labels = np.array([0, 1, 1, 0])
    mrpc = glue.score(glue.glue_task("mrpc"), labels, logits)
    assert mrpc == {"f1": pytest.approx(2 / 3), "accuracy": 0.75}
    cola = glue.score(glue.glue_task("cola"), labels, logits)
    assert set(cola) == {"mcc", "accuracy"}
    assert cola["mcc"] == pytest.approx(skm.matthews_corrcoef(labels, [0, 1, 0, 0]))
    stsb = glue.score(glue.glue_task("sts-b"), np.array([0.0, 1.0, 4.0]), np.array([[0.5], [1.5], [3.0]]))
    assert set(stsb) == {"pearson", "spearman"} and stsb["spearman"] == pytest.approx(1.0)


# ---- RoBERTa's input format, head and schedule ----


def test_inputs_are_roberta_s_with_megaformer_s_special_ids():
    encode = lambda text: [len(w) for w in text.split()]  # noqa: E731  (a stand-in tokenizer)
    assert glue.encode_example(("a bb",), encode, 16) == [BOS_ID, 1, 2, EOD_ID]
    # <s> A </s></s> B </s>
    assert glue.encode_example((" a bb ", "ccc"), encode, 16) == [BOS_ID, 1, 2, EOD_ID, EOD_ID, 3, EOD_ID]
    # Too long: the longer sentence loses tokens from its end first.
    ids = glue.encode_example(("a a a a a a a a", "bb bb"), encode, 10)
    assert ids == [BOS_ID, 1, 1, 1, 1, EOD_ID, EOD_ID, 2, 2, EOD_ID]


def test_head_is_roberta_s_classification_head():
    head = ft.ClassificationHead(8, 3, pooler_dropout=0.0)
    assert head.dense.weight.shape == (8, 8) and head.out_proj.weight.shape == (3, 8)
    features = torch.randn(2, 5, 8)
    expected = head.out_proj(torch.tanh(head.dense(features[:, 0])))
    torch.testing.assert_close(head(features), expected)  # reads the first token only


def test_mean_pooling_averages_the_non_padding_positions():
    head = ft.ClassificationHead(8, 2, pooling="mean")
    features = torch.randn(2, 5, 8)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])
    pooled = torch.stack([features[0].mean(0), features[1, :3].mean(0)])
    torch.testing.assert_close(head(features, keep), head.out_proj(torch.tanh(head.dense(pooled))))
    torch.testing.assert_close(head(features)[0], head(features, keep)[0])  # no mask: every position
    with pytest.raises(ValueError, match="pooling='max': expected one of first, mean"):
        ft.ClassificationHead(8, 2, pooling="max")


def test_mean_pooled_logits_of_a_padded_row_equal_the_row_alone():
    """The padding neither reaches attention nor the mean: batching does not change a prediction."""
    lm = NormFormerLM(tiny_config(seq_len=16), seed=1)
    model = ft.SentenceClassifier(lm, 2, pooling="mean").eval()
    rows = [[BOS_ID, 11, 12, 13, 14, 15, EOD_ID], [BOS_ID, 21, 22, EOD_ID]]
    with torch.no_grad():
        batched = model(ft.pad_batch(rows))
        alone = torch.cat([model(torch.tensor([r])) for r in rows])
        first = ft.SentenceClassifier(lm, 2).eval()
        first.head.load_state_dict(model.head.state_dict())
        other = first(ft.pad_batch(rows))
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batched, other, atol=1e-4)  # the mean is not the first token


def test_schedule_warms_up_linearly_then_decays_to_zero():
    f = ft.polynomial_decay(total=100, warmup=6)
    assert [f(n) for n in (0, 1, 3, 6)] == [1 / 6, 1 / 6, 0.5, 1.0]  # fairseq: no update at rate 0
    assert f(53) == pytest.approx(0.5) and f(100) == f(120) == 0.0
    assert ft.polynomial_decay(total=10, warmup=0)(0) == 1.0


def test_padding_is_masked_out_of_attention():
    """The first token's features of a right-padded row equal those of the row alone."""
    config = tiny_config(seq_len=16)
    lm = NormFormerLM(config, seed=1)
    model = ft.SentenceClassifier(lm, 2).eval()
    rows = [[BOS_ID, 11, 12, 13, 14, 15, EOD_ID], [BOS_ID, 21, 22, EOD_ID]]
    with torch.no_grad():
        padded = model.features(ft.pad_batch(rows))
        alone = [model.features(torch.tensor([r]))[0] for r in rows]
        unmasked = lm.final_norm(lm.blocks[1](lm.blocks[0](lm.embedding(ft.pad_batch(rows)))))
    assert ft.pad_batch(rows)[1, 4:].eq(PAD_ID).all()
    for i, r in enumerate(rows):
        torch.testing.assert_close(padded[i, : len(r)], alone[i], atol=1e-5, rtol=1e-5)
    # Without the mask the short row's first token would see the padding.
    assert not torch.allclose(unmasked[1, 0], alone[1][0], atol=1e-3)
    assert all(b.key_padding_mask is None for b in lm.blocks)  # the mask is gone afterwards


# ---- learning: a separable task ----


def _separable(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Class 0 sentences of tokens 1000..1099, class 1 of tokens 2000..2099, 4 to 12 tokens."""
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for _ in range(n):
        label = int(rng.integers(0, 2))
        body = rng.integers(1000 + 1000 * label, 1100 + 1000 * label, int(rng.integers(4, 13)))
        rows.append([BOS_ID, *body.tolist(), EOD_ID])
        labels.append(label)
    return rows, labels


def test_a_separable_task_is_learnt_to_over_95_percent():
    config = tiny_config(seq_len=32)
    hp = ft.FinetuneConfig(epochs=3, batch_size=16, seed=0)
    run = ft.finetune_one(
        full_weights(config), config, glue.glue_task("sst2"), _separable(320, 0), _separable(200, 1), 1e-3, hp
    )
    assert run["updates"] == 60 and run["warmup"] == 4
    assert [h["epoch"] for h in run["epochs"]] == [1, 2, 3]
    assert run["best"]["metrics"]["accuracy"] > 0.95, run["epochs"]


def test_sts_b_is_a_regression_with_one_output_and_mse():
    config = tiny_config(seq_len=32)
    rows, labels = _separable(48, 2)
    scores = [4.5 if y else 0.5 for y in labels]
    hp = ft.FinetuneConfig(epochs=1, batch_size=16, max_steps=2)
    run = ft.finetune_one(
        full_weights(config), config, glue.glue_task("stsb"), (rows, scores), (rows, scores), 1e-3, hp
    )
    assert run["updates"] == 2 and set(run["best"]["metrics"]) == {"pearson", "spearman"}
    model = ft.build_classifier(full_weights(config), config, glue.glue_task("stsb"), hp, "cpu")
    assert model.head.out_proj.out_features == 1
    assert model.lm.config.hidden_dropout == model.lm.config.attention_dropout == 0.1  # RoBERTa's


# ---- the command: real RTE data, a causal checkpoint, bad flags ----


def test_rte_from_a_tiny_masked_lm_checkpoint_end_to_end(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "run", tiny_config(seq_len=128))
    argv = ["--checkpoint", str(ckpt), "--task", "rte", "--data", str(GLUE_DIR), "--device", "cpu"]
    argv += ["--lr", "1e-4", "1e-3", "--epochs", "2", "--max-steps", "4", "--max-train-examples", "160"]
    assert ft.main(argv) == 0
    out = tmp_path / "run" / "finetune"
    doc = json.loads((out / "rte.json").read_text())  # strict JSON (no NaN)
    assert doc["task"] == "RTE" and doc["model"]["name"] == "run"
    assert doc["data"]["train_examples"] == 160 and doc["data"]["valid_examples"] == 277  # GLUE's dev
    assert [r["lr"] for r in doc["runs"]] == [1e-4, 1e-3]
    assert all(r["updates"] == 4 and len(r["epochs"]) == 1 for r in doc["runs"])  # 4 updates < 1 epoch
    best = doc["best"]
    assert best["selected_by"] == "accuracy" and best["lr"] in (1e-4, 1e-3)
    assert best["metrics"]["accuracy"] == max(r["best"]["metrics"]["accuracy"] for r in doc["runs"])
    assert doc["hyperparameters"]["adam_betas"] == [0.9, 0.98] and doc["hyperparameters"]["batch_size"] == 16
    table = (out / "table3.md").read_text()
    header = "| Model | Size (M) | λ_resid | PPL | CoLA | MNLI | MRPC | QNLI | QQP | RTE | SST-2 | Avg |"
    assert header in table
    row = next(line for line in table.splitlines() if line.startswith("| run |"))
    # † : this run differs from the paper's recipe (2 lrs, 2 epochs, 4 updates, 160 examples).
    assert f"| {100 * best['metrics']['accuracy']:.1f}† |" in row and "(1/7)" in row
    assert doc["recipe_differences"] == [
        "learning rates {0.0001, 0.001} (recipe: {1e-05, 0.0001, 0.0003, 0.001, 0.003, 0.006})",
        "2 epochs (recipe: 10)",
        "4 updates per learning rate (--max-steps; the epochs': 20)",
        "160 of GLUE's 2,490 training examples",
        f"{doc['data']['truncated_to_seq_len']['train']} training / "
        f"{doc['data']['truncated_to_seq_len']['valid']} validation inputs reach seq_len 128 and may be "
        "cut (roberta-base: 512 positions)",
    ]
    assert "| run | RTE | " + "; ".join(doc["recipe_differences"]) + " |" in table
    # The accuracy's 95% Wilson interval, in the JSON and the table.
    ci = best["accuracy_ci95"]
    assert ci["n"] == 277 and ci["correct"] == round(best["metrics"]["accuracy"] * 277)
    assert ci["low"] < best["metrics"]["accuracy"] < ci["high"] and ci["method"] == "wilson"
    assert f"| run | RTE | {100 * ci['correct'] / 277:.1f} | [{100 * ci['low']:.1f}, " in table
    assert doc["data"]["valid_majority"] == 146 / 277 and len(best["predictions"]) == 277
    # The best model, saved where every tool reads it.
    assert best["checkpoint"] == str(out / "rte_best" / "checkpoint_best")
    assert (out / "rte_best" / "latest").read_text() == "checkpoint_best"
    capsys.readouterr()
    assert ft.main(["--table", str(out)]) == 0
    assert header in capsys.readouterr().out


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_the_best_model_is_saved_reloaded_and_exported_like_any_checkpoint(tmp_path, pooling):
    """OUT/<task>_best: megaformer's checkpoint format with the head beside the encoder; reloaded, it
    predicts exactly the recorded best epoch's validation accuracy; consolidate, export_hf and
    finetune's own --checkpoint read it."""
    from megaformer.checkpoint.reshard import consolidate

    ckpt = write_checkpoint(tmp_path / "run", tiny_config(seq_len=64))
    out = tmp_path / "ft"
    argv = ["--checkpoint", str(ckpt), "--task", "sst2", "--data", str(GLUE_DIR), "--device", "cpu"]
    argv += ["--lr", "1e-3", "3e-3", "--epochs", "2", "--max-train-examples", "64"]
    argv += ["--max-valid-examples", "96", "--batch-size", "16", "--out", str(out), "--pooling", pooling]
    # --test-file: the same 96 dev rows as a held-out file, so its score must be the best epoch's
    dev_lines = (GLUE_DIR / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "held_out.tsv").write_text("".join(dev_lines[:97]), encoding="utf-8")
    argv += ["--test-file", str(tmp_path / "held_out.tsv")]
    assert ft.main(argv) == 0
    doc = json.loads((out / "sst-2.json").read_text())
    best = doc["best"]
    test = doc["test"]  # scored once by the model kept in memory: the selected epoch's numbers
    assert test["file"] == str(tmp_path / "held_out.tsv") and test["examples"] == 96
    assert test["selected_at"] == {"lr": best["lr"], "epoch": best["epoch"]}
    assert test["metrics"] == best["metrics"] and test["predictions"] == best["predictions"]
    assert test["accuracy_ci95"] == best["accuracy_ci95"] and test["labels"] == doc["data"]["valid_labels"]
    model, task, info = ft.load_classifier(str(out / "sst-2_best"))
    assert model.head.pooling == pooling  # read back from the saved hyperparameters
    assert task.name == "SST-2" and (info["lr"], info["epoch"]) == (best["lr"], best["epoch"])
    assert info["init"] == "pretrained" and info["source_checkpoint"] == str(ckpt / "global_step1")
    # Re-encode the same 96 validation rows and predict: the recorded accuracy and predictions.
    examples = glue.read_glue_file(str(GLUE_DIR / "SST-2" / "dev.tsv"), task, 96)
    rows, labels, _ = ft.encode_split(examples, ft._tokenizer(ft.build_parser().parse_args([])).encode, 64)
    outputs = ft.predict(model, rows, 16, "cpu")
    assert "".join(str(i) for i in outputs.argmax(-1)) == best["predictions"]
    assert glue.score(task, np.asarray(labels), outputs)["accuracy"] == best["metrics"]["accuracy"]
    # The encoder is a masked LM checkpoint like any run's: same architecture, fine-tuned weights.
    full, run_config, extra = consolidate(str(out / "sst-2_best" / "checkpoint_best"))
    assert run_config["model"] == to_dict(RunConfig(model=tiny_config(seq_len=64)))["model"]
    assert extra["step"] == 1 and set(full) == set(full_weights(tiny_config(seq_len=64)))
    assert not torch.equal(
        full["tied_modules.embed.token.weight"],
        full_weights(tiny_config(seq_len=64))["tied_modules.embed.token.weight"],
    )
    again = ft.load_masked_lm(str(out / "sst-2_best"))  # finetune --checkpoint OUT/sst-2_best
    assert again[2]["tag_dir"] == str(out / "sst-2_best" / "checkpoint_best")
    with pytest.raises(ConfigError, match="no classification head; not a model saved by"):
        ft.load_classifier(str(ckpt))  # a pretraining checkpoint
    pytest.importorskip("transformers")
    from megaformer.tools.export_hf import export

    hf = export(str(out / "sst-2_best"), str(tmp_path / "hf"))
    assert (
        hf["architectures"] == ["MegaformerForMaskedLM"] and (tmp_path / "hf" / "model.safetensors").is_file()
    )


def test_a_causal_lm_checkpoint_is_refused_naming_model_objective(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "clm", tiny_config("clm"))
    with pytest.raises(ConfigError, match=r"model\.objective='clm'"):
        ft.load_masked_lm(str(ckpt))
    argv = ["--checkpoint", str(ckpt), "--task", "rte", "--data", str(GLUE_DIR), "--lr", "1e-4"]
    assert ft.main(argv) == 2
    err = capsys.readouterr().err
    assert "model.objective='clm'" in err and "model.objective='mlm'" in err and "global_step1" in err
    assert not (tmp_path / "clm" / "finetune").exists()


def test_an_unknown_task_or_a_bad_data_file_is_an_error_before_the_checkpoint_is_read(tmp_path, capsys):
    missing_ckpt = str(tmp_path / "nothing")
    assert ft.main(["--checkpoint", missing_ckpt, "--task", "rtee", "--data", str(GLUE_DIR)]) == 2
    assert "'rtee': not a GLUE task; choose one of cola, sst2, mrpc" in capsys.readouterr().err
    bad = tmp_path / "RTE"
    bad.mkdir()
    (bad / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tmaybe\n")
    (bad / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tA.\tB.\tentailment\n")
    ckpt = write_checkpoint(tmp_path / "run", tiny_config())
    assert ft.main(["--checkpoint", str(ckpt), "--task", "RTE", "--data", str(tmp_path), "--lr", "1e-4"]) == 2
    assert f"{bad / 'dev.tsv'}:2: label 'maybe' is not one of RTE's labels" in capsys.readouterr().err
    # a --test-file without labels (GLUE's own test.tsv) is refused before the checkpoint is read
    unlabelled = tmp_path / "test.tsv"
    unlabelled.write_text("index\tsentence\n0\tfine .\n")
    argv = [
        "--checkpoint",
        missing_ckpt,
        "--task",
        "sst2",
        "--data",
        str(GLUE_DIR),
        "--test-file",
        str(unlabelled),
    ]
    assert ft.main(argv) == 2
    assert f"{unlabelled}:1: no column 'label' in the header" in capsys.readouterr().err


def test_flags_are_checked(capsys):
    with pytest.raises(SystemExit) as e:
        ft.main(["--task", "rte"])
    assert e.value.code == 2 and "--checkpoint, --data required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ft.main(["--checkpoint", "x", "--task", "rte", "--data", "d", "--lr", "0"])
    assert "--lr values must be > 0" in capsys.readouterr().err
    assert ft.PAPER_LR_GRID == (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 6e-3)
    assert ft.build_parser().parse_args([]).lr == list(ft.PAPER_LR_GRID)  # the default grid


# ---- the random-initialisation control, the accuracy's interval, the recipe's marks ----


def test_random_init_fine_tunes_the_architecture_from_the_trainer_s_initial_weights(tmp_path, monkeypatch):
    """--random-init: the checkpoint's architecture at the weights its pretraining started from
    (train.seed, or --init-seed), written beside, not over, the pretrained model's results."""
    config = tiny_config(seq_len=64)
    ckpt = write_checkpoint(tmp_path / "run", config)  # weights of seed 3; the run's train.seed: 1234
    start = ft.initial_weights(config, 1234)
    reference = NormFormerLM(config, seed=1234)
    assert torch.equal(start["tied_modules.embed.token.weight"],
                       reference.embedding.token.weight.detach()[:MLM_VOCAB_SIZE])  # fmt: skip
    assert not torch.equal(start["tied_modules.embed.token.weight"],
                           full_weights(config)["tied_modules.embed.token.weight"])  # fmt: skip
    seen = []
    original = ft.build_classifier
    monkeypatch.setattr(ft, "build_classifier", lambda full, *a: seen.append(full) or original(full, *a))
    argv = ["--checkpoint", str(ckpt), "--task", "sst2", "--data", str(GLUE_DIR), "--device", "cpu"]
    argv += ["--lr", "1e-3", "--epochs", "1", "--max-steps", "2", "--max-train-examples", "32"]
    argv += ["--max-valid-examples", "40", "--random-init"]
    assert ft.main(argv) == 0
    assert all(torch.equal(seen[0][k], v) for k, v in start.items())  # the initial weights, not seed 3's
    out = tmp_path / "run" / "finetune-random-init"
    doc = json.loads((out / "sst-2.json").read_text())
    assert doc["model"]["name"] == "run (random init)" and doc["model"]["init"] == "random"
    assert doc["model"]["init_seed"] == 1234 and doc["model"]["step"] == 0 and doc["ppl"] is None
    assert doc["recipe_differences"][0] == "random initialisation, not pretrained (seed 1234)"
    assert "accuracy_ci95" in doc["best"] and not (tmp_path / "run" / "finetune").exists()
    assert ft.load_classifier(str(out / "sst-2_best"))[2]["init"] == "random"
    assert ft.main([*argv, "--init-seed", "7", "--no-save-best", "--out", str(tmp_path / "s7")]) == 0
    assert json.loads((tmp_path / "s7" / "sst-2.json").read_text())["model"]["init_seed"] == 7
    seven = ft.initial_weights(config, 7)
    assert all(torch.equal(seen[-1][k], v) for k, v in seven.items())
    assert not (tmp_path / "s7" / "sst-2_best").exists()  # --no-save-best


def test_init_seed_without_random_init_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        ft.main(["--checkpoint", "x", "--task", "sst2", "--data", "d", "--init-seed", "3"])
    assert e.value.code == 2 and "add --random-init, or drop --init-seed" in capsys.readouterr().err


@pytest.mark.parametrize(("correct", "n"), [(0, 10), (3, 10), (10, 10), (146, 277), (795, 872)])
def test_accuracy_interval_is_wilson_s_as_scipy_computes_it(correct, n):
    ci = ft.accuracy_interval(correct / n, n)
    expected = stats.binomtest(correct, n).proportion_ci(0.95, method="wilson")
    assert (ci["low"], ci["high"]) == (pytest.approx(expected.low), pytest.approx(expected.high))
    # Wilson's formula by hand: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n).
    z, p = stats.norm.ppf(0.975), correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert ci["low"] == pytest.approx(max(0.0, (centre - half) / (1 + z * z / n)), abs=1e-9)
    assert ci["high"] == pytest.approx(min(1.0, (centre + half) / (1 + z * z / n)), abs=1e-9)
    assert ci["correct"] == correct and ci["n"] == n and ci["method"] == "wilson"
    with pytest.raises(ValueError, match="not a count k/n"):
        ft.accuracy_interval(0.5, 0)
    with pytest.raises(ValueError, match="not a count k/n"):
        ft.accuracy_interval(0.123456, 10)


def _doc(**changes) -> dict:
    """A <task>.json document that followed the recipe (SST-2, GLUE's whole sets)."""
    cut = {"train": 0, "valid": 0, "seq_len": 512}
    hp = {**dataclasses.asdict(ft.FinetuneConfig(batch_size=32)), "lr_grid": list(ft.PAPER_LR_GRID)}
    doc = {
        "task": "SST-2",
        "model": {"name": "m", "init": "pretrained", "params": 1e6, "resid_scale": False},
        "data": {"train_examples": 67349, "valid_examples": 872, "truncated_to_seq_len": cut},
        "hyperparameters": hp,
        "best": {"lr": 1e-5, "epoch": 3, "metrics": {"accuracy": 0.5}},
        "best_glue": {"lr": 1e-5, "epoch": 3, "metrics": {"accuracy": 0.5}},
    }
    for key, value in changes.items():
        section, field = key.split("__")
        doc[section][field] = value
    return json.loads(json.dumps(doc))  # as read back from the file (tuples become lists)


def test_recipe_differences_name_every_setting_that_differs():
    assert ft.recipe_differences(_doc()) == []
    assert ft.recipe_differences(_doc(model__init="random", model__init_seed=5)) == [
        "random initialisation, not pretrained (seed 5)"
    ]
    assert ft.recipe_differences(_doc(hyperparameters__batch_size=16)) == ["batch size 16 (recipe: 32)"]
    assert ft.recipe_differences(_doc(data__train_examples=10000)) == [
        "10,000 of GLUE's 67,349 training examples"
    ]
    assert ft.recipe_differences(_doc(hyperparameters__max_steps=100000)) == []  # cut nothing
    assert ft.recipe_differences(_doc(hyperparameters__weight_decay=0.01)) == [
        "weight_decay 0.01 (recipe: 0.1)"
    ]
    assert ft.recipe_differences(_doc(hyperparameters__lr_grid=[6e-3, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3])) == []
    assert ft.recipe_differences(_doc(hyperparameters__pooling="mean")) == ["pooling mean (recipe: first)"]
    table = ft.render_tables(
        [_doc(), {**_doc(data__valid_examples=100), "model": {**_doc()["model"], "name": "n"}}]
    )
    assert "| m | 1.00 | - | – | – | – | – | – | – | – | 50.0 |" in table  # no mark
    assert "| n | 1.00 | - | – | – | – | – | – | – | – | 50.0† |" in table
    assert "| n | SST-2 | 100 of GLUE's 872 validation examples |" in table
    assert "| m | SST-2 | 50.0 | [46.7, 53.3] | 436 / 872 | – |" in table  # computed for old documents
    assert "None: every run followed the recipe." in ft.render_tables([_doc()])


def test_the_best_model_is_the_first_best_and_nan_never_beats_it():
    config = tiny_config(seq_len=16)
    model = ft.SentenceClassifier(NormFormerLM(config, seed=1), 2)
    keeper = ft.BestModel(glue.glue_task("sst2"))
    outputs = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert keeper.offer(model, {"accuracy": math.nan}, outputs, lr=1.0, epoch=1)  # the first is kept
    assert keeper.offer(model, {"accuracy": 0.5}, outputs, lr=1.0, epoch=2)
    assert not keeper.offer(model, {"accuracy": 0.5}, outputs, lr=2.0, epoch=1)  # a tie: the first stays
    assert not keeper.offer(model, {"accuracy": math.nan}, outputs, lr=2.0, epoch=2)
    assert (keeper.info["lr"], keeper.info["epoch"], keeper.predictions) == (1.0, 2, "01")
    assert keeper.lm_state["tied_modules.embed.token.weight"].shape[0] == MLM_VOCAB_SIZE  # padding cut


def test_paired_difference_of_two_models_on_the_same_examples():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 872)
    pred_a = np.where(rng.random(872) < 0.8, labels, 1 - labels)  # ~80% right
    pred_b = np.where(rng.random(872) < 0.7, labels, 1 - labels)  # ~70% right

    def doc(name, preds):
        d = _doc()
        d["model"]["name"] = name
        d["data"]["valid_labels"] = "".join(map(str, labels))
        d["best"]["predictions"] = "".join(map(str, preds))
        d["best"]["metrics"]["accuracy"] = float(np.mean(preds == labels))
        return d

    a, b = doc("pretrained", pred_a), doc("random init", pred_b)
    got = ft.paired_difference(a, b)
    right_a, right_b = pred_a == labels, pred_b == labels
    diff = right_a.astype(float) - right_b.astype(float)  # per example: -1, 0 or 1
    half = stats.norm.ppf(0.975) * diff.std() / math.sqrt(872)  # the Wald interval of a mean
    assert got["difference"] == pytest.approx(diff.mean()) and got["n"] == 872
    assert (got["low"], got["high"]) == (pytest.approx(diff.mean() - half), pytest.approx(diff.mean() + half))
    only_a, only_b = int(np.sum(right_a & ~right_b)), int(np.sum(right_b & ~right_a))
    assert (got["only_a"], got["only_b"]) == (only_a, only_b)
    assert got["mcnemar_p"] == pytest.approx(stats.binomtest(only_a, only_a + only_b).pvalue)
    assert got["accuracy_a"] == a["best"]["metrics"]["accuracy"]
    assert ft.paired_difference(b, a)["difference"] == pytest.approx(-got["difference"])
    assert ft.paired_difference(a, a)["mcnemar_p"] == 1.0 and ft.paired_difference(a, a)["high"] == 0.0
    other = doc("other set", pred_b)
    other["data"]["valid_labels"] = "".join(map(str, 1 - labels))
    assert ft.paired_difference(a, other) is None and ft.paired_difference(a, _doc()) is None
    table = ft.render_tables([a, b])
    line = next(x for x in table.splitlines() if x.startswith("| SST-2 | pretrained | random init |"))
    assert f"| {100 * got['difference']:+.1f} | [{100 * got['low']:+.1f}, {100 * got['high']:+.1f}] |" in line
    assert "## Paired differences" not in ft.render_tables([_doc()])
