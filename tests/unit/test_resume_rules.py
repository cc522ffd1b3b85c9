"""Resume compares the saved config with the new one: which keys may change, the extension rule."""

from __future__ import annotations

import pytest

from megaformer.checkpoint.resume_rules import check_resume_config, config_changes
from megaformer.config import ConfigError, load_config, to_dict
from megaformer.training.schedule import extension_rule, lr_at

CONFIG = "configs/normformer-quickstart.yaml"
BASE = ["train.steps=20", "train.warmup_steps=2", "train.lr_decay=linear"]


def _saved():
    return to_dict(load_config(CONFIG, BASE))


def test_same_config_and_cadence_changes_pass():
    assert check_resume_config(_saved(), load_config(CONFIG, BASE), 10, "ckpt") == []
    cadence = load_config(
        CONFIG, [*BASE, "train.log_interval=3", "train.save_interval=7", "output.dir=/elsewhere"]
    )
    lines = check_resume_config(_saved(), cadence, 10, "ckpt")
    assert lines == [
        "resume: changed since the checkpoint (allowed): output.dir, train.log_interval, train.save_interval"
    ]


def test_changed_model_and_steps_are_listed_and_refused():
    new = load_config(CONFIG, [*BASE, "model.hidden_size=256", "train.lr=1e-3", "train.steps=30"])
    with pytest.raises(ConfigError) as err:
        check_resume_config(_saved(), new, 20, "run/checkpoints/global_step20")
    msg = str(err.value)
    assert "model.hidden_size: saved 128, now 256" in msg and "train.lr: saved" in msg
    assert "train.steps: saved 20, now 30" in msg and "global_step20" in msg
    assert set(config_changes(_saved(), new)) == {"model.hidden_size", "train.lr", "train.steps"}


def test_steps_change_alone_names_the_flag_and_extension_states_the_lr_rule():
    with pytest.raises(ConfigError, match=r"add train.extend_steps=true"):
        check_resume_config(_saved(), load_config(CONFIG, [*BASE, "train.steps=30"]), 20, "ckpt")
    ext = load_config(CONFIG, [*BASE, "train.steps=30", "train.extend_steps=true"])
    lines = check_resume_config(_saved(), ext, 20, "ckpt", extension_rule)
    t = ext.train
    assert lr_at(20, t, 20) != lr_at(20, t)  # the old schedule had ended: the rule matters
    assert f"takes lr {lr_at(20, t):.3e} where the old schedule had {lr_at(20, t, 20):.3e}" in lines[0]
    assert "recomputed over 30 steps" in lines[0]
    with pytest.raises(ConfigError, match=r"set train\.steps above it"):
        check_resume_config(
            _saved(), load_config(CONFIG, [*BASE, "train.steps=15", "train.extend_steps=true"]), 20, "ckpt"
        )


def test_a_fresh_start_into_a_run_directory_is_refused_unless_asked(tmp_path):
    from megaformer.checkpoint.manager import check_output_dir

    run = tmp_path / "run"
    fresh = load_config(CONFIG, [f"output.dir={run}"])
    check_output_dir(fresh)  # nothing there yet
    (run / "checkpoints" / "global_step5").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("global_step5")
    with pytest.raises(ConfigError, match="holds another run") as err:
        check_output_dir(fresh)
    assert "latest" in str(err.value) and "train.resume=auto" in str(err.value)
    check_output_dir(load_config(CONFIG, [f"output.dir={run}", "output.overwrite=true"]))
    check_output_dir(load_config(CONFIG, [f"output.dir={run}", "train.resume=auto"]))
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "global_step5").rmdir()
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(ConfigError, match="tensorboard"):
        check_output_dir(fresh)


def test_init_from_at_or_past_train_steps_is_refused_before_the_run(tmp_path):
    from megaformer.checkpoint.integrity import write_manifest
    from megaformer.checkpoint.resume_rules import check_init_from_steps

    tag = tmp_path / "src" / "checkpoints" / "global_step20"
    tag.mkdir(parents=True)
    write_manifest(str(tag), {}, 20)
    (tmp_path / "src" / "checkpoints" / "latest").write_text("global_step20")
    for steps in (10, 20):
        cfg = load_config(
            CONFIG,
            [
                f"train.init_from={tag.parent}",
                f"train.steps={steps}",
                "train.warmup_steps=2",
                f"output.dir={tmp_path}/new",
            ],
        )
        with pytest.raises(ConfigError, match=r"saved at step 20.*set train\.steps above 20"):
            check_init_from_steps(cfg)
    check_init_from_steps(
        load_config(CONFIG, [f"train.init_from={tag.parent}", "train.steps=30", "train.warmup_steps=2"])
    )


def test_init_from_compares_the_model_config_with_missing_keys_at_their_defaults(tmp_path):
    # A checkpoint written before model.init existed (its saved model config lacks the key) was
    # refused by init_from with "saved with another model config {}": a key the saved config lacks
    # counts as its default, as for a resume; a real difference is named with both values, and is
    # refused before any process group from the manifest's config.
    from megaformer.checkpoint.integrity import write_manifest
    from megaformer.checkpoint.resume_rules import check_init_from_steps, refuse_other_model
    from megaformer.config import to_dict

    tag = tmp_path / "src" / "checkpoints" / "global_step20"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text("global_step20")
    overrides = [f"train.init_from={tag.parent}", "train.steps=30", "train.warmup_steps=2"]
    cfg = load_config(CONFIG, overrides)
    older = to_dict(cfg)
    del older["model"]["init"]
    refuse_other_model(older, cfg)
    write_manifest(str(tag), {}, 20, older)
    check_init_from_steps(cfg)

    wider = load_config(CONFIG, [*overrides, f"model.hidden_size={cfg.model.hidden_size * 2}"])
    with pytest.raises(
        ConfigError,
        match=rf"model\.hidden_size: saved {cfg.model.hidden_size}, now {cfg.model.hidden_size * 2}",
    ):
        check_init_from_steps(wider)
    with pytest.raises(ConfigError, match=r"saved with another model config \(model\.hidden_size"):
        refuse_other_model(older, wider)


def test_a_key_newer_than_the_checkpoint_counts_as_its_default():
    # A checkpoint written before a key existed must resume when the key is left at its default,
    # and still be refused when the key is set to something else.
    from megaformer.checkpoint.resume_rules import check_resume_config
    from megaformer.config import ConfigError, load_config, to_dict

    cfg = load_config("configs/normformer-quickstart.yaml", [])
    saved = to_dict(cfg)
    del saved["model"]["norm_scheme"]
    assert check_resume_config(saved, cfg, 5, "ckpt") == []
    changed = load_config("configs/normformer-quickstart.yaml", ["model.qkv_ln=true"])
    saved_without = to_dict(cfg)
    del saved_without["model"]["qkv_ln"]
    assert check_resume_config(saved_without, cfg, 5, "ckpt") == []
    with pytest.raises(ConfigError, match=r"model\.qkv_ln: saved False, now True"):
        check_resume_config(saved_without, changed, 5, "ckpt")


def test_a_budget_run_resumes_on_a_machine_of_another_speed():
    """budget.machine_factor describes where a run trains (compare's re-check), not what it
    trains: a calibrated budget run preempted on one machine resumes on a slower one."""
    budget = ["budget.device_hours=1", "budget.step_seconds=0.5"]
    saved = to_dict(load_config(CONFIG, [*BASE, *budget]))
    slower = load_config(CONFIG, [*BASE, *budget, "budget.machine_factor=1.15"])
    assert check_resume_config(saved, slower, 10, "ckpt") == [
        "resume: changed since the checkpoint (allowed): budget.machine_factor"
    ]


def test_every_rule_is_checked_before_the_launch_from_the_manifests(tmp_path):
    """check_before_launch (launch/pretrain.sh's --check-config): a changed train.steps without
    train.extend_steps, a changed model on resume, and train.init_from with another model shape or
    a spent step count are refused from the checkpoints' manifests, in one process, before any
    worker starts (issue 39: 12-19 s, once per rank, then the launcher's 'Killing subprocess')."""
    from megaformer.checkpoint.integrity import write_manifest
    from megaformer.checkpoint.resume_rules import check_before_launch

    run = tmp_path / "run"
    tag = run / "checkpoints" / "global_step10"
    tag.mkdir(parents=True)
    write_manifest(str(tag), {}, 10, _saved())
    (run / "checkpoints" / "latest").write_text("global_step10")
    here = [*BASE, f"output.dir={run}", "train.resume=auto"]
    said = check_before_launch(load_config(CONFIG, here))  # the same run: only allowed changes
    assert said == ["resume: changed since the checkpoint (allowed): output.dir, train.resume"]
    with pytest.raises(ConfigError, match=r"train\.steps: saved 20, now 30 \(to extend the run, add train"):
        check_before_launch(load_config(CONFIG, [*here, "train.steps=30"]))
    lines = check_before_launch(load_config(CONFIG, [*here, "train.steps=30", "train.extend_steps=true"]))
    assert "extending the run from 20 to 30 steps" in lines[0]
    with pytest.raises(ConfigError) as err:
        check_before_launch(load_config(CONFIG, [*here, "model.num_layers=6"]))
    # the suggested fix works: init_from refuses another model, so it is not offered for one
    assert "model.num_layers: saved 4, now 6" in str(err.value) and "init_from" not in str(err.value)
    with pytest.raises(
        ConfigError, match=r"train\.seed: .*train\.init_from=\.\.\. starts one from these weights"
    ):
        check_before_launch(load_config(CONFIG, [*here, "train.seed=7"]))
    fresh = [*BASE, f"output.dir={tmp_path / 'new'}", f"train.init_from={run}"]
    with pytest.raises(ConfigError, match=r"model\.hidden_size: saved 128, now 256"):
        check_before_launch(load_config(CONFIG, [*fresh, "model.hidden_size=256"]))
    with pytest.raises(ConfigError, match=r"saved at step 10, and train\.steps=10 leaves nothing"):
        check_before_launch(load_config(CONFIG, [*fresh, "train.steps=10"]))
    with pytest.raises(ConfigError, match=r"no such file or directory"):
        check_before_launch(load_config(CONFIG, [*BASE, f"train.init_from={tmp_path / 'nope'}"]))
    assert check_before_launch(load_config(CONFIG, fresh)) == []


def test_init_from_a_resharded_checkpoint_is_checked_before_the_launch(tmp_path):
    """reshard's output names its config in the manifest, so ``train.init_from`` of it with another
    model shape is refused before any worker (rerunning issue 39's commands found the manifest
    without it: the refusal came from every rank after start-up)."""
    from megaformer.checkpoint.integrity import read_manifest
    from megaformer.checkpoint.reshard import reshard, split, write_module_checkpoint
    from megaformer.checkpoint.resume_rules import check_before_launch
    from megaformer.model import NormFormerLM, vocab_param_names

    cfg = load_config(CONFIG, BASE)
    vocab_rows = set(vocab_param_names(cfg.model))  # consolidated weights: vocabulary padding cut
    full = {
        n: (p.detach()[: cfg.model.vocab_size] if n in vocab_rows else p.detach())
        for n, p in NormFormerLM(cfg.model, seed=0).named_parameters()
    }
    src = tmp_path / "run" / "checkpoints"
    write_module_checkpoint(str(src), "global_step10", split(full, cfg.model, 1), to_dict(cfg), 10)
    tag = reshard(str(src), str(tmp_path / "re"), tp=1)
    assert read_manifest(tag)["config"]["model"] == to_dict(cfg)["model"]
    fresh = [*BASE, f"output.dir={tmp_path / 'new'}", f"train.init_from={tmp_path / 're'}"]
    with pytest.raises(ConfigError, match=r"model\.hidden_size: saved 128, now 256"):
        check_before_launch(load_config(CONFIG, [*fresh, "model.hidden_size=256"]))
    assert check_before_launch(load_config(CONFIG, fresh)) == []
