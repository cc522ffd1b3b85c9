"""fairseq parity: ``megaformer.tools.import_fairseq`` on the reference fixture made with fairseq's own
code (tests/fixtures/fairseq/README.md), read back through the tools' loading path."""

from __future__ import annotations

import argparse
import fractions
import json
import os
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint.safe_load import UntrustedCheckpointError
from megaformer.tools.generate import load_for_generation
from megaformer.tools.import_fairseq import FairseqImportError, import_fairseq, main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fairseq"
REL_BOUND = 1e-4  # the bound: max |Δlogit| / max |logit|, fp32


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "reference.pt", weights_only=True)


def _max_rel_error(model, ref) -> float:
    """Over the fixture's rows run unpadded (row 0 whole; rows 1 and 2: their 11 non-pad tokens
    alone, which fairseq scores as in the padded batch), max |Δlogit| / max |fairseq logit|."""
    worst = 0.0
    with torch.no_grad():
        for r in range(ref["tokens"].shape[0]):
            keep = ref["nonpad_mask"][r]
            ours = model(ref["tokens"][r][keep][None])[0, :, : ref["logits"].shape[-1]]
            want = ref["logits"][r][keep]
            worst = max(worst, float((ours - want).abs().max() / want.abs().max()))
    return worst


@pytest.mark.parametrize("name", ["model.pt", "model_cfg.pt"])
def test_imported_fixture_gives_fairseqs_logits(name, tmp_path, reference):
    tag_dir = import_fairseq(str(FIXTURE / name), str(tmp_path))
    assert tag_dir == str(tmp_path / "checkpoints" / "global_step0")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step0"
    manifest = json.loads((Path(tag_dir) / "manifest.json").read_text())
    assert manifest["step"] == 0 and "mp_rank_00_model_states.pt" in manifest["files"]
    assert (tmp_path / "dict.txt").read_bytes() == (FIXTURE / "dict.txt").read_bytes()
    # The tools' own loading path (generate / evaluate / export_hf / init_from: consolidate + load_full).
    model, config, step = load_for_generation(str(tmp_path / "checkpoints"))
    assert step == 0
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (80, 64, 2)
    assert (config.num_attention_heads, config.ffn_size, config.seq_len) == (4, 128, 64)
    assert config.post_attn_ln and config.head_scale and config.ffn_ln and config.resid_scale
    assert config.head_scale_position == "after_out_proj" and config.position_offset == 2
    assert config.init == "fairseq" and config.scale_embedding and config.tie_embeddings
    assert config.layernorm_eps == 1e-5 and config.activation == "gelu"
    err = _max_rel_error(model, reference)
    print(f"{name}: max relative logit error {err:.2e}")
    assert err <= REL_BOUND
    # Row 0 to fairseq's absolute precision too (the fixture's README: atol 1e-5 catches every
    # misplaced operation it lists).
    with torch.no_grad():
        row0 = model(reference["tokens"][:1])[0, :, :80]
    assert (row0 - reference["logits"][0]).abs().max() <= 1e-5


def test_the_fairseq_switches_are_what_makes_it_match(tmp_path, reference):
    """Negative controls: the paper's HeadScale placement, or positions from 0, miss fairseq's logits."""
    import dataclasses

    from megaformer.checkpoint.reshard import consolidate, load_full, resolve_tag_dir
    from megaformer.config.schema import ModelConfig
    from megaformer.model import NormFormerLM

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path))
    full, run_config, _ = consolidate(resolve_tag_dir(str(tmp_path / "checkpoints")))
    config = ModelConfig(**run_config["model"])
    for change in ({"head_scale_position": "before_out_proj"}, {"position_offset": 0}):
        other = dataclasses.replace(config, **change)
        model = NormFormerLM(other, seed=0).eval()
        load_full(model, full, other, tp_rank=0, tp=1)
        assert _max_rel_error(model, reference) > 1e-2, change


def test_resharded_import_keeps_fairseqs_function(tmp_path, reference):
    """reshard to TP 2 (heads split, the after-W_O HeadScale γ replicated) and back: the same logits."""
    from megaformer.checkpoint.reshard import reshard

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path / "imported"))
    reshard(str(tmp_path / "imported" / "checkpoints"), str(tmp_path / "tp2"), tp=2)
    assert len(list((tmp_path / "tp2" / "global_step0").glob("mp_rank_*_model_states.pt"))) == 2
    model, _, _ = load_for_generation(str(tmp_path / "tp2"))
    assert _max_rel_error(model, reference) <= REL_BOUND


def _fairseq_state() -> dict:
    return torch.load(FIXTURE / "model_cfg.pt", weights_only=True)


def _save(tmp_path, ckpt, name="bad.pt") -> str:
    path = str(tmp_path / name)
    torch.save(ckpt, path)
    return path


def test_a_disallowed_pickled_type_is_refused_naming_it(tmp_path, capsys):
    ckpt = torch.load(FIXTURE / "model.pt", weights_only=False)
    assert isinstance(ckpt["args"], argparse.Namespace)  # the one type the reader allows
    ckpt["extra_state"]["lr"] = fractions.Fraction(1, 3)
    path = _save(tmp_path, ckpt)
    with pytest.raises(UntrustedCheckpointError) as e:
        import_fairseq(path, str(tmp_path / "out"))
    assert "fractions.Fraction" in str(e.value) and "argparse" not in str(e.value)
    assert not (tmp_path / "out").exists()
    assert main(["--checkpoint", path, "--output", str(tmp_path / "out")]) == 2
    assert "fractions.Fraction" in capsys.readouterr().err
    # The escape for a trusted source.
    assert main(["--checkpoint", path, "--output", str(tmp_path / "out"), "--trust-checkpoint-code"]) == 0
    assert (tmp_path / "out" / "checkpoints" / "global_step0" / "mp_rank_00_model_states.pt").is_file()


def _edit(key: str, value):
    def apply(ckpt):
        if value is None:
            del ckpt["model"][key]
        else:
            ckpt["model"][key] = value

    return apply


def _set_flag(key: str, value):
    def apply(ckpt):
        ckpt["cfg"]["model"][key] = value

    return apply


BAD = {
    "untied": (_edit("decoder.output_projection.weight", torch.zeros(80, 64)), "output_projection"),
    "learned positions": (_edit("decoder.embed_positions.weight", torch.zeros(66, 64)), "embed_positions"),
    "layernorm_embedding": (
        _edit("decoder.layernorm_embedding.weight", torch.ones(64)),
        "layernorm_embedding",
    ),
    "adaptive softmax": (_edit("decoder.adaptive_softmax.tail.0.weight", torch.ones(2)), "adaptive_softmax"),
    "old version": (_edit("decoder.version", torch.tensor([2.0])), "decoder.version"),
    "no final LN": (_edit("decoder.layer_norm.weight", None), "decoder.layer_norm.weight"),
    "unknown key": (_edit("decoder.layers.0.encoder_attn.k_proj.weight", torch.ones(2)), "encoder_attn"),
    "layers differ": (_edit("decoder.layers.1.c_attn", None), "decoder.layers.1"),
    "relu": (_set_flag("activation_fn", "relu"), "activation_fn='relu'"),
    "tanh gelu": (_set_flag("activation_fn", "gelu_accurate"), "gelu_accurate"),
    "heads": (_set_flag("decoder_attention_heads", 8), "c_attn"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_cannot_be_mapped_is_refused_naming_the_key(case, tmp_path):
    edit, words = BAD[case]
    ckpt = _fairseq_state()
    edit(ckpt)
    path = _save(tmp_path, ckpt)
    with pytest.raises(FairseqImportError) as e:
        import_fairseq(path, str(tmp_path / "out"))
    assert words in str(e.value) and path in str(e.value)
    assert not (tmp_path / "out").exists()


def test_bad_inputs(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["--checkpoint", str(tmp_path / "missing.pt"), "--output", out]) == 2
    assert "missing.pt: no such file" in capsys.readouterr().err
    not_fairseq = _save(tmp_path, {"weights": torch.zeros(2)})
    with pytest.raises(FairseqImportError, match="not a fairseq checkpoint"):
        import_fairseq(not_fairseq, out)
    short = tmp_path / "short_dict.txt"
    short.write_text("w00 5\nw01 4\n")
    with pytest.raises(FairseqImportError, match=r"2 symbols \+ 4 fairseq specials = 6, but .* 80 rows"):
        import_fairseq(str(FIXTURE / "model.pt"), out, dict_path=str(short))
    with pytest.raises(FairseqImportError, match="no such file"):
        import_fairseq(str(FIXTURE / "model.pt"), out, dict_path=str(tmp_path / "nope.txt"))
    assert not os.path.exists(out)


def test_imported_checkpoint_evaluates_and_starts_a_run(tmp_path, capsys):
    """``evaluate`` and ``train.init_from`` (through the trainer, with the written config.yaml) accept
    the import."""
    import subprocess
    import sys

    import numpy as np

    from data_tools import stats
    from data_tools.indexed_dataset import IndexedDatasetWriter
    from megaformer.tools import evaluate

    prefix = str(tmp_path / "fs_text_document")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(200):  # fairseq ids: symbols 4..79, each document ending in </s> = 2
        writer.add_document([*rng.integers(4, 80, int(rng.integers(20, 120))).tolist(), 2])
    writer.finalize()
    assert stats.main(["--data-prefix", prefix, "--eod-token", "2"]) == 0
    out = tmp_path / "imported"
    import_fairseq(str(FIXTURE / "model.pt"), str(out))
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(out / "checkpoints"), "--data-prefix", prefix]) == 0
    assert "nats/token" in capsys.readouterr().out
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaformer.train",
            str(out / "config.yaml"),
            f"data.prefix={prefix}",
            f"train.init_from={out / 'checkpoints'}",
            f"output.dir={tmp_path / 'run'}",
            "train.steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "train.warmup_steps=1",
            "train.eval_interval=100",
            "train.eval_batches=1",
            "train.save_interval=2",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "initialised weights from" in run.stdout and "step 2/2" in run.stdout
    assert (tmp_path / "run" / "checkpoints" / "global_step2" / "manifest.json").is_file()


def test_gpt2_vocab_reorders_the_embedding_to_gpt2_ids(tmp_path, reference, capsys):
    """``--vocab gpt2``: with a dictionary of GPT-2 ids (as fairseq's --bpe gpt2 writes it), the
    fixture's tokens rewritten as GPT-2 ids give fairseq's logits at the GPT-2 ids of its symbols,
    ``</s>`` read as <|endoftext|> (50256) and ``<unk>`` as any id the dictionary lacks."""
    rng = torch.Generator().manual_seed(0)
    ids = (torch.randperm(50256, generator=rng)[:75] + 0).tolist()  # 75 BPE ids, never 50256
    symbols = [str(g) for g in ids] + ["madeupword0000"]  # 76 lines: the fixture's 80 rows - 4
    (tmp_path / "dict.txt").write_text("".join(f"{s} {1000 - i}\n" for i, s in enumerate(symbols)))
    out = tmp_path / "imported"
    assert main(["--checkpoint", str(FIXTURE / "model.pt"), "--dict", str(tmp_path / "dict.txt"),
                 "--output", str(out), "--vocab", "gpt2"]) == 0  # fmt: skip
    assert "75 BPE ids" in capsys.readouterr().out
    model, config, _ = load_for_generation(str(out / "checkpoints"))
    assert config.vocab_size == 50257
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["eod_token"] == 50256
    unk_id = next(g for g in range(50256) if g not in set(ids))
    to_gpt2 = {2: 50256, 3: unk_id} | {4 + i: g for i, g in enumerate(ids)}
    cols = torch.tensor([to_gpt2[t] for t in range(2, 79)])  # fairseq columns 2..78 (no madeupword)
    with torch.no_grad():
        for r in range(reference["tokens"].shape[0]):
            keep = reference["nonpad_mask"][r]
            tokens = torch.tensor([to_gpt2[int(t)] for t in reference["tokens"][r][keep]])
            ours = model(tokens[None])[0][:, cols]
            want = reference["logits"][r][keep][:, 2:79]
            assert (ours - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6, r
    # A dictionary of other symbols is refused at its line; --vocab gpt2 without one too.
    bad = tmp_path / "words.txt"
    bad.write_text("".join(f"w{i:02d} 5\n" for i in range(76)))
    with pytest.raises(FairseqImportError, match=r"words.txt:1: symbol 'w00' is not a GPT-2 BPE id"):
        import_fairseq(str(FIXTURE / "model.pt"), str(tmp_path / "o2"), str(bad), vocab="gpt2")
    twice = tmp_path / "twice.txt"
    twice.write_text("".join(f"{7 if i in (3, 9) else 100 + i} 5\n" for i in range(76)))
    with pytest.raises(FairseqImportError, match=r"twice.txt:10: GPT-2 id 7 appears twice"):
        import_fairseq(str(FIXTURE / "model.pt"), str(tmp_path / "o3"), str(twice), vocab="gpt2")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "model.pt").write_bytes((FIXTURE / "model.pt").read_bytes())
    with pytest.raises(FairseqImportError, match=r"--vocab gpt2: no dict\.txt beside"):
        import_fairseq(str(lone / "model.pt"), str(tmp_path / "o4"), vocab="gpt2")


def test_tools_take_the_import_directory_its_checkpoints_or_one_step(tmp_path):
    """Every tool that reads a checkpoint resolves it through resolve_tag_dir: the directory
    import_fairseq wrote (a run directory: it holds checkpoints/), its checkpoints/ directory and the
    global_step0 inside it are one checkpoint; a mistyped path is answered as such (issue 39)."""
    from megaformer.checkpoint.reshard import ReshardError, resolve_tag_dir

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path / "imported"))
    step = tmp_path / "imported" / "checkpoints" / "global_step0"
    for given in (tmp_path / "imported", tmp_path / "imported" / "checkpoints", step):
        assert resolve_tag_dir(str(given)) == str(step), given
    assert resolve_tag_dir(str(tmp_path / "imported"), "global_step0") == str(step)
    with pytest.raises(ReshardError, match=r"imported2: no such file or directory; pass a run directory"):
        resolve_tag_dir(str(tmp_path / "imported2"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReshardError, match=r"neither mp_rank_XX_model_states.pt files nor a 'latest' file"):
        resolve_tag_dir(str(tmp_path / "empty"))


def test_zero_shot_names_rows_after_the_model_not_its_folder():
    from megaformer.tools.zero_shot import row_name

    assert row_name(None, "/x/exports/nf-125m") == "nf-125m"  # was "exports", the parent's name
    assert row_name("/x/runs/nf", None) == "nf"
    assert row_name("/x/runs/nf/checkpoints", None) == "nf"
    assert row_name("/x/runs/nf/checkpoints/global_step450", None) == "nf@global_step450"


def test_reading_weights_does_not_import_deepspeed(tmp_path):
    """A tool that only reads weights (generate, evaluate, zero_shot, export_hf) does not import
    DeepSpeed (seconds of start-up and its banner) unless the file names one of its classes
    (issue 39): checked in a fresh interpreter."""
    import subprocess
    import sys

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path / "imported"))
    code = (
        "import sys\n"
        "from megaformer.tools.generate import load_for_generation\n"
        f"load_for_generation({str(tmp_path / 'imported')!r}, None, False)\n"
        "print('deepspeed' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        out.stdout.strip().splitlines()[-1] == "False"
        and "Setting accelerator" not in out.stdout + out.stderr
    )


def test_zero_shot_ppl_reads_at_most_its_token_cap(tmp_path, capsys):
    """zero_shot's PPL column reads the first --ppl-max-tokens tokens of its dataset (the bundled
    4.9M-token corpus took over 10 minutes without a word), says how many, and shows progress."""
    import argparse

    import numpy as np

    from data_tools.indexed_dataset import IndexedDatasetWriter
    from megaformer.tools.zero_shot import _model

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path / "imported"))
    config = load_for_generation(str(tmp_path / "imported"), None, False)[1]
    prefix = tmp_path / "text_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for _ in range(20):
            writer.add_document(rng.integers(0, config.vocab_size, size=200))
    args = argparse.Namespace(
        hf_model=None, checkpoint=str(tmp_path / "imported"), tag=None, batch_size=4, device="cpu",
        trust_checkpoint_code=False, ppl_data_prefix=str(prefix), ppl_max_tokens=600,
    )  # fmt: skip
    _, _, capped = _model(args)
    said = capsys.readouterr().err
    seq_len = config.seq_len
    assert f"over the first {600 // seq_len * seq_len:,} tokens" in said and "PPL" in said
    _, _, whole = _model(argparse.Namespace(**{**vars(args), "ppl_max_tokens": 0}))
    assert f"over the first {(20 * 200 - 1) // seq_len * seq_len:,} tokens" in capsys.readouterr().err
    assert capped != whole and capped > 1


def test_zero_shot_tasks_none_prints_the_ppl_column_alone(tmp_path, capsys):
    """``zero_shot --tasks none --ppl-data-prefix P``: the perplexity part alone, no task loaded (a
    user without the hub's datasets got the PPL line and then exit 2 after 35 s of retries); refused
    without a PPL dataset or beside --task, before the model loads."""
    import numpy as np

    from data_tools.indexed_dataset import IndexedDatasetWriter
    from megaformer.tools import zero_shot

    import_fairseq(str(FIXTURE / "model_cfg.pt"), str(tmp_path / "imported"))
    config = load_for_generation(str(tmp_path / "imported"), None, False)[1]
    prefix = tmp_path / "text_text_document"
    with IndexedDatasetWriter(str(prefix), np.uint16) as writer:
        for _ in range(4):
            writer.add_document(np.random.default_rng(0).integers(0, config.vocab_size, size=200))
    ckpt = ["--checkpoint", str(tmp_path / "imported"), "--device", "cpu"]
    assert zero_shot.main([*ckpt, "--tasks", "none", "--ppl-data-prefix", str(prefix)]) == 0
    out = capsys.readouterr()
    assert "PPL" in out.err and out.out.strip().startswith("imported: |θ|") and "PPL -" not in out.out
    beside_a_task = ["--tasks", "none", "--ppl-data-prefix", str(prefix), "--task", "piqa=x"]
    for bad in (["--tasks", "none"], beside_a_task):
        with pytest.raises(SystemExit) as e:
            zero_shot.main([*ckpt, *bad])
        assert e.value.code == 2 and "--tasks none scores no task" in capsys.readouterr().err
