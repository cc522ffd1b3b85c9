"""What may change when a run resumes: the saved config against the new one, key by key.

A resumed run must be the run that was saved: the same model, data, layout, optimizer and seed,
so that it continues exactly. Only keys that do not change what is computed may differ
(:data:`MAY_CHANGE`: output cadence, evaluation size, stopping, loader workers), and
``train.steps`` when the run is extended on purpose (``train.extend_steps=true``).

Extension rule for the learning rate (logged on resume): the schedule is recomputed for the new
``train.steps`` (same warmup; the decay now ends at the new last step), so the next update's
learning rate is the new schedule's at that step, not the old one's. The sample order does not
depend on the run length (:mod:`data_tools.sample_index`), so the extended run serves new samples.

The saved config is read from the checkpoint's manifest (or, for a checkpoint written before
manifests, from its first model-states file, memory-mapped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megaformer.checkpoint.integrity import read_manifest, resolve_latest
from megaformer.config import ConfigError, RunConfig, to_dict
from megaformer.config.load import migrate_saved

MAY_CHANGE = frozenset(
    {
        "train.log_interval",
        "train.eval_interval",
        "train.save_interval",
        "train.eval_batches",
        "train.final_eval_batches",
        "model.fused_kernels",  # the same function, fused (Triton) or eager; rounding only
        "train.keep_last_checkpoints",
        "train.exit_signals",
        "train.exit_duration_mins",
        "train.extend_steps",
        "train.resume",
        "train.init_from",
        "train.trust_checkpoint_code",
        "budget.machine_factor",
        "train.diagnostics_interval",
        "train.recompute",
        "train.activation_checkpointing",
        "parallel.timeout_minutes",
        "data.num_workers",
        "data.index_cache_dir",
        "output.dir",
        "output.overwrite",
        "output.wandb_project",
        "output.wandb_entity",
        "output.wandb_run_name",
        "output.lock",
        "output.lease_timeout_seconds",
    }
)
"""Keys that may differ between the saved config and a resumed run's (``train.steps`` apart)."""


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """``{"section.key": (saved value, new value)}`` for every key that differs. A key the saved
        config lacks (written by an older megaformer) counts as its default value there, so a new key
        left at its default does not stop the resume; a key only the saved config has shows None now. A
    key that moved section since (:data:`~megaformer.config.load.MOVED_KEYS`) is compared under its
    new name."""
    default = _flat(to_dict(RunConfig()))
    old, new = _flat(migrate_saved(saved)), _flat(to_dict(cfg))
    old = {k: old.get(k, default.get(k)) for k in set(old) | set(new)}
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def check_resume_config(
    saved: dict,
    cfg: RunConfig,
    step: int,
    where: str,
    explain_extension: Callable[[RunConfig, int, int], str] | None = None,
) -> list[str]:
    """Refuse a resume whose config differs from the saved one in a key that may not change.

    Args:
        saved: the config the checkpoint was written with.
        cfg: the new run's config.
        step: the checkpoint's step.
        where: the checkpoint directory (for the messages).
        explain_extension: ``(cfg, step, old_steps) -> line`` stating an extension's learning-rate
            rule (the trainer passes :func:`megaformer.training.schedule.extension_rule`; the
            schedule is training's, so this package does not import it). None: a plain line.

    Returns:
        Log lines: the keys that changed and were allowed, the learning-rate rule of an extension.

    Raises:
        ConfigError: listing every refused key with its saved and new value, and the fix.
    """
    changes = config_changes(saved, cfg)
    refused = {k: v for k, v in changes.items() if k not in MAY_CHANGE and k != "train.steps"}
    lines = []
    if "train.steps" in changes:
        old_steps, new_steps = changes["train.steps"]
        if not cfg.train.extend_steps:
            refused["train.steps"] = changes["train.steps"]
        elif new_steps <= step:
            raise ConfigError(
                f"train.steps={new_steps}: the checkpoint {where} is at step {step}; set train.steps above it"
            )
        else:
            lines.append(
                explain_extension(cfg, step, old_steps)
                if explain_extension is not None
                else f"extending the run from {old_steps} to {new_steps} steps (train.extend_steps=true)"
            )
    if refused:
        listed = "; ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in refused.items())
        model_changed = any(k.startswith("model.") for k in refused)
        hint = (
            " (to extend the run, add train.extend_steps=true)"
            if "train.steps" in refused and len(refused) == 1
            else "; resume with the saved values, or start a new run in another output.dir"
            # train.init_from loads the weights into the same model only: offered where it works
            + ("" if model_changed else " (train.init_from=... starts one from these weights)")
        )
        raise ConfigError(f"resuming from {where}: the config differs from the saved one in {listed}{hint}")
    allowed = [k for k in changes if k in MAY_CHANGE]
    if allowed:
        lines.append("resume: changed since the checkpoint (allowed): " + ", ".join(allowed))
    return lines


def saved_config(tag_dir: str) -> dict | None:
    """The run config a checkpoint was saved with (None when it has none: not megaformer's)."""
    import glob
    import os

    body = read_manifest(tag_dir)
    if body is not None and isinstance(body.get("config"), dict):
        return body["config"]
    files = sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt")))
    if not files:
        return None
    # lazy: imports torch; check_before_launch (the launcher, before any worker) must not
    from megaformer.checkpoint.safe_load import load_weights

    config = load_weights(files[0]).get("config")
    return config if isinstance(config, dict) else None


def model_changes(saved: dict, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The ``model.*`` keys of :func:`config_changes`: what ``train.init_from`` may not change (a
    key the saved config lacks counts as its default, as for a resume)."""
    return {k: v for k, v in config_changes(saved, cfg).items() if k.startswith("model.")}


def refuse_other_model(saved: dict, cfg: RunConfig) -> None:
    """Raise if ``train.init_from``'s checkpoint was saved with another model configuration.

    Raises:
        ConfigError: naming each differing key with its saved and its current value.
    """
    changes = model_changes(saved, cfg)
    if changes:
        said = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changes.items())
        raise ConfigError(
            f"train.init_from='{cfg.train.init_from}' was saved with another model config ({said}); "
            "init_from loads weights into the same model at any layout: set those keys as saved"
        )


def check_init_from_steps(cfg: RunConfig) -> None:
    """Refuse ``train.init_from`` whose checkpoint step leaves nothing to train (``train.steps`` at
    or below it), or that was saved with another model configuration, before any process group
    starts (step and config are read from the manifest; a checkpoint without one is checked when
    its weights are loaded).

    Raises:
        ConfigError: naming the checkpoint's step or the differing model keys, and the fix.
    """
    # lazy: imports torch; check_before_launch (the launcher, before any worker) must not
    from megaformer.checkpoint.reshard import resolve_tag_dir

    if not cfg.train.init_from or (cfg.train.resume != "none" and _has_latest(cfg)):
        return
    body = read_manifest(resolve_tag_dir(cfg.train.init_from))
    if body is not None and int(body["step"]) >= cfg.train.steps:
        raise ConfigError(
            f"train.init_from='{cfg.train.init_from}' was saved at step {body['step']}, and "
            f"train.steps={cfg.train.steps} leaves nothing to train: set train.steps above {body['step']}"
        )
    if body is not None and isinstance(body.get("config"), dict):
        refuse_other_model(body["config"], cfg)


def _has_latest(cfg: RunConfig) -> bool:
    """Whether train.resume will find a checkpoint (then train.init_from is ignored)."""
    import os

    where = os.path.join(cfg.output.dir, "checkpoints") if cfg.train.resume == "auto" else cfg.train.resume
    return os.path.isfile(os.path.join(where, "latest"))


def _latest_tag_dir(ckpt_dir: str) -> str | None:
    """The tag directory ``ckpt_dir/latest`` names, ``ckpt_dir`` itself when it is a tag directory
    (it holds model-state files), or None where there is no checkpoint."""
    import glob
    import os

    if glob.glob(os.path.join(ckpt_dir, "*model_states.pt")):
        return ckpt_dir
    if os.path.isfile(os.path.join(ckpt_dir, "latest")):
        return resolve_latest(ckpt_dir)
    nested = os.path.join(ckpt_dir, "checkpoints")  # a run directory
    return _latest_tag_dir(nested) if os.path.isdir(nested) else None


def check_before_launch(cfg: RunConfig) -> list[str]:
    """The resume and ``train.init_from`` rules, checked before the launcher starts any worker
    (``launch/pretrain.sh`` runs ``megaformer.train --check-config``): read from the checkpoints'
    manifests (JSON; no torch, no DeepSpeed: a fraction of a second), so a refusal is said once, in
    under a second, not by every rank after start-up. What only the workers can check (a
    checkpoint without a manifest, damaged files, the weights' shapes) stays with them.

    Returns:
        The log lines of an allowed change (an extension's learning-rate rule).

    Raises:
        ConfigError: a resume whose config differs in a key that may not change (or a changed
            ``train.steps`` without ``train.extend_steps``); ``train.init_from`` with another model
            or a step that leaves nothing to train; ``train.resume`` naming a directory without a
            checkpoint.
        CheckpointError: a ``latest`` file that is empty or names no directory.
    """
    import os

    t = cfg.train
    resume_dir = None
    if t.resume == "auto":
        own = os.path.join(cfg.output.dir, "checkpoints")
        resume_dir = own if os.path.isfile(os.path.join(own, "latest")) else None
    elif t.resume != "none":
        if not os.path.isfile(os.path.join(t.resume, "latest")):
            raise ConfigError(
                f"train.resume='{t.resume}': no DeepSpeed checkpoint there (no 'latest' file); "
                "use auto, none or a directory written by a previous run's checkpoints/."
            )
        resume_dir = t.resume
    if resume_dir is not None:
        tag_dir = _latest_tag_dir(resume_dir)
        body = read_manifest(tag_dir) if tag_dir else None
        if body is None or not isinstance(body.get("config"), dict):
            return []  # an older checkpoint: the workers read its config from the weights
        return check_resume_config(body["config"], cfg, int(body["step"]), tag_dir)
    if t.init_from:
        if not os.path.exists(t.init_from):
            raise ConfigError(
                f"train.init_from='{t.init_from}': no such file or directory; give a run directory, its "
                "checkpoints/ directory or one global_stepN"
            )
        tag_dir = _latest_tag_dir(t.init_from)
        body = read_manifest(tag_dir) if tag_dir else None
        if body is not None and int(body["step"]) >= t.steps:
            raise ConfigError(
                f"train.init_from='{t.init_from}' was saved at step {body['step']}, and "
                f"train.steps={t.steps} leaves nothing to train: set train.steps above {body['step']}"
            )
        if body is not None and isinstance(body.get("config"), dict):
            refuse_other_model(body["config"], cfg)
    return []
