"""Strict loading of a run config: YAML file + ``section.key=value`` overrides -> frozen RunConfig.

Rules (each violation is a :class:`ConfigError` naming the file, key or value and the fix):

* the YAML has only the sections ``model``, ``data``, ``parallel``, ``train``, ``output``;
* every key exists in its section's dataclass (a close match is suggested);
* every value has the field's type (ints are accepted for float fields; bools are not ints);
* the named validators below accept the values (ranges, choices, cross-field rules).

Rules that need the world size (batch divisibility, tp × pp × dp) are checked by
:func:`validate_layout`; rules that need files (datasets, checkpoints, the DeepSpeed JSON) by the
trainer's preflight (:mod:`megaformer.training.preflight`). Both run before any process group
starts. Loading itself is pure: it reads the YAML and imports nothing but the standard library
and PyYAML (a test checks that ``import megaformer.config`` imports no torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import os
import types
from collections.abc import Callable, Iterable
from typing import Any, get_type_hints

import yaml

from megaformer.config.schema import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    BUDGET_SKIP_STEPS,
    COMPILE_AUTO,
    FUSED_KERNELS,
    HEAD_SCALE_POSITIONS,
    INITS,
    MLM_HEAD_POSITIONS,
    MLM_VOCAB_SIZE,
    NORM_SCHEMES,
    OBJECTIVES,
    POSITION_EMBEDDINGS,
    PRE_LN_ONLY,
    BudgetConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "budget": BudgetConfig,
    "output": OutputConfig,
}
MOVED_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("train", f"budget_{name}"): ("budget", name)
    for name in (
        "device_hours",
        "measure_steps",
        "step_seconds",
        "eval_seconds",
        "fixed_seconds",
        "overrun",
        "machine_factor",
    )
}
"""Keys that moved to another section (old -> new): refused in a config the user writes, with the
new name; carried over in a run's own record (a ``config.json`` or a checkpoint's config, written by
an earlier version), so that its runs still load, resume and compare (:func:`migrate_saved`)."""


def migrate_saved(sections: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (``{section: {key: value}}``, from its ``config.json`` or a checkpoint)
    with every :data:`MOVED_KEYS` old key under its new name; a new copy, the input unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in sections.items()}
    for (section, key), (new_section, new_key) in MOVED_KEYS.items():
        body = out.get(section)
        if isinstance(body, dict) and key in body:
            out.setdefault(new_section, {})
            out[new_section].setdefault(new_key, body.pop(key))
    return out


def _moved(where: str, section: str, key: str) -> None:
    """Refuse an old key of :data:`MOVED_KEYS`, naming the new one.

    Raises:
        ConfigError: ``where: train.budget_overrun is now budget.overrun ...``.
    """
    if (section, key) in MOVED_KEYS:
        new_section, new_key = MOVED_KEYS[(section, key)]
        raise ConfigError(
            f"{where}: {section}.{key} is now {new_section}.{new_key} (the run-length settings have their "
            f"own section); write it under '{new_section}:' in the YAML, or as {new_section}.{new_key}=VALUE"
        )


def _suggest(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _coerce(where: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotation ``typ`` (int, float, bool, str, or a union of them,
    tried in order: ``bool | str`` takes a bool as is); ints widen to float."""
    if isinstance(typ, types.UnionType):
        for option in typ.__args__:
            with contextlib.suppress(ConfigError):
                return _coerce(where, value, option)
        names = " or ".join(option.__name__ for option in typ.__args__)
        raise ConfigError(f"{where}: expected {names}, got {value!r} ({type(value).__name__}).")
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _looks_like_float(value):
            # PyYAML follows YAML 1.1, where `lr: 3e-3` (no dot in the mantissa) is a string.
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # A YAML override like output.dir=2024 parses as an int; a path is still meant.
            return str(value)
    else:  # pragma: no cover - schema only uses the four scalar types
        raise TypeError(f"unsupported config field type {typ!r} at {where}")
    raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r} ({type(value).__name__}).")


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected section.key=value, e.g. train.steps=100.")
    key, raw = item.split("=", 1)
    if key.count(".") != 1:
        raise ConfigError(f"override '{item}': the key must be section.key, e.g. train.lr=3e-4.")
    section, name = key.split(".")
    # YAML parsing gives 3e-4 -> float, true -> bool, 100 -> int, anything else -> str.
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(raw):
        value = float(raw)  # YAML 1.1 reads "3e-4" as a string; users mean a number
    return section, name, value


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _blend_from_list(where: str, items: list) -> str:
    """``data.blend`` written as a YAML list, as Megatron's ``--data-path`` string.

    Accepted: one ``"weight prefix"`` string per item, ``[weight, prefix]`` pairs, or the flat
    ``[weight, prefix, weight, prefix, ...]``; the weights and prefixes themselves are checked by
    the preflight (``data_tools.blend.parse_blend``).

    Raises:
        ConfigError: an item that is a mapping or a nested list that is not a pair.
    """
    words: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, list) and len(item) == 2 and all(not isinstance(x, (list, dict)) for x in item):
            words += [str(x) for x in item]
        elif isinstance(item, (str, int, float)) and not isinstance(item, bool):
            words.append(str(item))
        else:
            raise ConfigError(
                f"{where}[{i}]: expected 'weight prefix', [weight, prefix] or a flat list of weights and "
                f"prefixes, got {item!r}; e.g. blend: ['0.7 data/a_text_document', "
                "'0.3 data/b_text_document']"
            )
    return " ".join(words)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            # A run's config.json is read as JSON: YAML 1.1 reads JSON's 1e-05 as a string.
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}: not valid JSON ({e.msg}).") from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found; pass a YAML from configs/.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{line}: not valid YAML ({getattr(e, 'problem', e)}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections {sorted(SECTIONS)}.")
    return data


def _layers(path: str, chain: tuple[str, ...] = ()) -> list[tuple[str, dict[str, Any]]]:
    """``[(file, its sections)]``: the configs ``path`` builds on through its ``base:`` key (a path
    relative to ``path``'s directory), the deepest first, then ``path`` itself; a later file's
    keys replace an earlier one's, key by key.

    Raises:
        ConfigError: a ``base`` that is not a string, names no file, or leads back to a file of the
            chain (named, in order).
    """
    data = dict(_read_yaml(path))
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base={base!r}: give the path of the config this one builds on.")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
    here = (*chain, os.path.abspath(path))
    if os.path.abspath(base_path) in here:
        loop = " -> ".join([*here, os.path.abspath(base_path)])
        raise ConfigError(f"{path}: base '{base}' leads back to a file of the chain ({loop}).")
    if not os.path.isfile(base_path):
        raise ConfigError(
            f"{path}: base '{base}': {base_path} not found (a base is resolved relative to the directory "
            "of the file that names it)."
        )
    return [*_layers(base_path, here), (path, data)]


def load_config(path: str | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load a YAML run config and apply ``section.key=value`` overrides.

    Args:
        path: YAML file with any of the sections model / data / parallel / train / budget / output,
            or None for the defaults. A top-level ``base: other.yaml`` (relative to the file) starts from
            that config: this file's keys replace the base's, key by key (chains allowed).
        overrides: strings like ``train.steps=100`` applied after the file, in order.

    Returns:
        A frozen, validated :class:`RunConfig`.

    Raises:
        ConfigError: unknown section or key (with a suggestion), wrong type, impossible value.
    """
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    origin = path or "<defaults>"
    for file, sections in _layers(path) if path is not None else []:
        if "provenance" in sections:  # a run's own config.json: an earlier version's names carry over
            sections = migrate_saved(sections)
        for section, body in sections.items():
            if section == "provenance":  # written into a run's config.json by the trainer; informational
                continue
            if section not in SECTIONS:
                raise ConfigError(
                    f"{file}: unknown section '{section}'; valid sections: {sorted(SECTIONS)}."
                    + _suggest(section, SECTIONS)
                )
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"{file}: section '{section}' must be a mapping of key: value.")
            for key, value in body.items():
                where = f"{file}: {section}.{key}"
                _moved(file, section, str(key))
                if (section, key) == ("data", "blend") and isinstance(value, list):
                    value = _blend_from_list(where, value)
                raw[section][str(key)] = (value, where)
    for item in overrides:
        section, name, value = _parse_override(item)
        if section not in SECTIONS:
            raise ConfigError(
                f"override '{item}': unknown section '{section}'; valid: {sorted(SECTIONS)}."
                + _suggest(section, SECTIONS)
            )
        _moved(f"override '{item}'", section, name)
        raw[section][name] = (value, f"override '{item}'")

    built = {}
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, (value, where) in raw[section].items():
            if key not in names:
                raise ConfigError(
                    f"{where}: unknown key '{section}.{key}'.{_suggest(key, names)} "
                    f"Valid keys of '{section}': {', '.join(names)}."
                )
            kwargs[key] = _coerce(where, value, hints[key])
        built[section] = cls(**kwargs)
    cfg = RunConfig(**built)
    for check in VALIDATORS:
        try:
            check(cfg)
        except ConfigError as e:
            raise ConfigError(f"{origin}: {e}") from None
    return cfg


# ---------------------------------------------------------------------------------------------
# Validators: small, named, one concern each. They raise ConfigError("key=value: why; fix").


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value > 0, f"{section}.{name}={value}: must be > 0.")


def _one_of(key: str, value: str, allowed: tuple[str, ...], note: str = "") -> None:
    shown = (
        " or ".join(f"'{a}'" for a in allowed)
        if len(allowed) < 3
        else (", ".join(f"'{a}'" for a in allowed[:-1]) + f" or '{allowed[-1]}'")
    )
    _require(value in allowed, f"{key}='{value}': use {shown}{note}.")


def check_model(cfg: RunConfig) -> None:
    check_model_config(cfg.model)


def check_model_config(m: ModelConfig) -> None:
    """The model section's rules, also applied by the model to a config built without the loader.

    Raises:
        ConfigError: a value out of range or not one of the allowed choices (message: key, value, fix).
    """
    _positive("model", m, "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_len")
    _positive("model", m, "make_vocab_size_divisible_by", "layernorm_eps", "init_std")
    _require(m.embedding_init_std >= 0, f"model.embedding_init_std={m.embedding_init_std}: must be >= 0.")
    _require(m.ffn_hidden_size >= 0, f"model.ffn_hidden_size={m.ffn_hidden_size}: must be >= 0.")
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
        f"{m.num_attention_heads}; pick a head count that divides it.",
    )
    _one_of("model.position_embedding", m.position_embedding, POSITION_EMBEDDINGS)
    _one_of("model.activation", m.activation, ACTIVATIONS)
    for name in ("hidden_dropout", "attention_dropout", "embedding_dropout"):
        p = getattr(m, name)
        _require(0.0 <= p < 1.0, f"model.{name}={p}: a probability in [0, 1).")
    _one_of("model.init", m.init, INITS, " ('legacy' is the default)")
    _require(
        not (m.init == "gpt2" and m.scale_embedding),
        "model.init='gpt2' with model.scale_embedding=true: GPT-2 does not multiply its token "
        "embedding by sqrt(d); set model.scale_embedding=false (or use model.init='fairseq', which does).",
    )
    _one_of("model.norm_scheme", m.norm_scheme, NORM_SCHEMES)
    _one_of("model.objective", m.objective, OBJECTIVES, " ('clm', the causal LM, is the default)")
    _one_of("model.mlm_head_positions", m.mlm_head_positions, MLM_HEAD_POSITIONS, " ('all' is the default)")
    _require(
        m.mlm_head_positions == "all" or m.objective == "mlm",
        f"model.mlm_head_positions='{m.mlm_head_positions}' with model.objective='{m.objective}': "
        "only the masked LM has masked positions; remove the key or set model.objective='mlm'.",
    )
    _one_of("model.fused_kernels", m.fused_kernels, FUSED_KERNELS, " ('auto', on for CUDA, is the default)")
    _one_of("model.attention_backend", m.attention_backend, ATTENTION_BACKENDS, " ('auto' is the default)")
    if m.objective == "mlm":
        _require(
            m.vocab_size >= MLM_VOCAB_SIZE,
            f"model.vocab_size={m.vocab_size} with model.objective='mlm': the masked LM's inputs hold "
            f"<mask>/<s>/<pad> (ids 50257..50259) above GPT-2's ids; set model.vocab_size={MLM_VOCAB_SIZE} "
            "(RoBERTa-base's vocabulary).",
        )
        _require(
            m.tie_embeddings,
            "model.tie_embeddings=false with model.objective='mlm': RoBERTa's LM head decodes with the "
            "token embedding; set model.tie_embeddings=true.",
        )
    _one_of(
        "model.head_scale_position",
        m.head_scale_position,
        HEAD_SCALE_POSITIONS,
        " ('before_out_proj', the paper's, is the default)",
    )
    _require(
        m.position_offset >= 0,
        f"model.position_offset={m.position_offset}: must be >= 0 (fairseq's positions start at 2).",
    )
    _require(
        m.position_offset == 0 or m.position_embedding == "sinusoidal",
        f"model.position_offset={m.position_offset} with model.position_embedding='{m.position_embedding}': "
        "the offset shifts the fixed sinusoidal table only (a learned table has seq_len rows and no "
        "offset); set model.position_offset=0 or use model.position_embedding='sinusoidal'.",
    )
    # NormFormer's operations and the '+ 3 More LN' ablation are defined on a Pre-LN layer (paper
    # Sec. 2, Table 4); under Post-LN / DeepNorm no reference defines them (and LN on v would undo
    # DeepNorm's beta-scaled W_V init): refuse rather than train an architecture nobody specified.
    if m.norm_scheme != "pre_ln":
        on = [k for k in PRE_LN_ONLY if getattr(m, k)]
        _require(
            not on,
            f"model.norm_scheme='{m.norm_scheme}' with {', '.join(f'model.{k}=true' for k in on)}: "
            "NormFormer's operations and qkv_ln are defined on Pre-LN only; set "
            f"{', '.join(f'model.{k}=false' for k in on)} (the Post-LN / DeepNorm baselines) or use "
            "model.norm_scheme='pre_ln'.",
        )


def check_parallel(cfg: RunConfig) -> None:
    p = cfg.parallel
    _positive("parallel", p, "tp_size", "pp_size")
    _require(
        p.backend in ("auto", "nccl", "gloo"), f"parallel.backend='{p.backend}': use auto, nccl or gloo."
    )
    _require(
        p.timeout_minutes > 0,
        f"parallel.timeout_minutes={p.timeout_minutes}: must be > 0 (minutes a collective may wait; "
        "default 30).",
    )
    m = cfg.model
    _require(
        m.num_attention_heads % p.tp_size == 0,
        f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp_size="
        f"{p.tp_size}; heads are split across the tensor-parallel group.",
    )
    _require(
        m.ffn_size % p.tp_size == 0,
        f"FFN width {m.ffn_size} is not divisible by parallel.tp_size={p.tp_size}.",
    )
    _require(
        not p.sequence_parallel or m.seq_len % p.tp_size == 0,
        f"parallel.sequence_parallel=true splits model.seq_len={m.seq_len} tokens across "
        f"parallel.tp_size={p.tp_size} ranks; use a seq_len divisible by {p.tp_size} or turn it off.",
    )
    _require(
        p.partition_method in ("parameters", "uniform", "type:NormFormerBlock"),
        f"parallel.partition_method='{p.partition_method}': use parameters, uniform or type:NormFormerBlock.",
    )
    _require(
        p.pp_size <= m.num_layers,
        f"parallel.pp_size={p.pp_size} stages for model.num_layers={m.num_layers} blocks; use at most "
        f"{m.num_layers} stages.",
    )
    # DeepSpeed refuses these inside deepspeed.initialize, after every process group exists.
    _require(
        p.pp_size == 1 or cfg.train.zero_stage <= 1,
        f"train.zero_stage={cfg.train.zero_stage} with parallel.pp_size={p.pp_size}: DeepSpeed's "
        "pipeline engine supports ZeRO stage 0 or 1 only (ZeRO-2/3 partition gradients, which the "
        "pipeline accumulates across micro-batches); use train.zero_stage=1 or parallel.pp_size=1.",
    )


def check_train(cfg: RunConfig) -> None:
    t = cfg.train
    _positive("train", t, "steps", "micro_batch_size", "global_batch_size", "lr", "log_interval")
    _positive("train", t, "eval_interval", "eval_batches", "adam_eps")
    _require(
        t.final_eval_batches >= -1,
        f"train.final_eval_batches={t.final_eval_batches}: must be -1 (as train.eval_batches), 0 (the "
        "whole held-out set) or a number of global batches.",
    )
    _require(t.min_lr >= 0 and t.min_lr <= t.lr, f"train.min_lr={t.min_lr}: must lie in [0, train.lr].")
    _require(
        0 <= t.warmup_steps <= t.steps,
        f"train.warmup_steps={t.warmup_steps}: must lie in [0, train.steps={t.steps}]; lower the warmup or "
        "raise train.steps.",
    )
    _require(
        t.lr_decay in ("cosine", "linear", "constant", "ramp"),
        f"train.lr_decay='{t.lr_decay}': cosine|linear|constant|ramp.",
    )
    _require(
        (t.lr_ramp > 0) == (t.lr_decay == "ramp"),
        f"train.lr_ramp={t.lr_ramp} with train.lr_decay='{t.lr_decay}': the ramp (the stability test) "
        "needs both train.lr_decay=ramp and train.lr_ramp > 0; set both or neither.",
    )
    _require(
        t.diagnostics_interval >= 0, f"train.diagnostics_interval={t.diagnostics_interval}: must be >= 0."
    )
    _require(
        t.divergence_factor == 0 or t.divergence_factor > 1,
        f"train.divergence_factor={t.divergence_factor}: 0 (off) or > 1 (a multiple of the lowest loss).",
    )
    for name in ("adam_beta1", "adam_beta2"):
        b = getattr(t, name)
        _require(0.0 <= b < 1.0, f"train.{name}={b}: must lie in [0, 1).")
    _require(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay}: must be >= 0.")
    _require(
        t.weight_decay_params in ("matrices", "all"),
        f"train.weight_decay_params='{t.weight_decay_params}': use 'matrices' (default) or 'all' (fairseq).",
    )
    _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 disables clipping).")
    _require(t.precision in ("fp32", "bf16", "fp16"), f"train.precision='{t.precision}': fp32, bf16 or fp16.")
    _require(
        t.zero_stage in (0, 1, 2, 3), f"train.zero_stage={t.zero_stage}: DeepSpeed ZeRO stage 0, 1, 2 or 3."
    )
    _require(t.save_interval >= 0, f"train.save_interval={t.save_interval}: must be >= 0.")
    _require(
        t.keep_last_checkpoints >= 0,
        f"train.keep_last_checkpoints={t.keep_last_checkpoints}: must be >= 0 (0 keeps every checkpoint).",
    )
    _require(
        t.exit_duration_mins >= 0, f"train.exit_duration_mins={t.exit_duration_mins}: must be >= 0 (0: off)."
    )
    for name in filter(None, (n.strip() for n in t.exit_signals.split(","))):
        _require(
            name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT"),
            f"train.exit_signals: '{name}' is not one of SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP, SIGCONT.",
        )
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
        f"{t.micro_batch_size}.",
    )
    _require(t.resume != "", "train.resume='': use none, auto or a checkpoint directory.")
    _check_budget(cfg)
    # Whether train.init_from / train.resume / train.deepspeed_config name readable files is checked
    # by the trainer's preflight (megaformer.training.preflight), before any process group starts:
    # loading a config reads the YAML and nothing else.


def _check_budget(cfg: RunConfig) -> None:
    """The ``budget`` section (see :class:`~megaformer.config.schema.BudgetConfig`)."""
    t, b = cfg.train, cfg.budget
    _require(b.device_hours >= 0, f"budget.device_hours={b.device_hours}: must be >= 0.")
    calibrated = b.step_seconds > 0
    _require(
        min(b.step_seconds, b.eval_seconds, b.fixed_seconds, b.overrun) >= 0,
        f"budget.step_seconds={b.step_seconds}, budget.eval_seconds={b.eval_seconds}, "
        f"budget.fixed_seconds={b.fixed_seconds}, budget.overrun={b.overrun}: must be >= 0.",
    )
    _require(
        b.machine_factor > 0 and (calibrated or b.machine_factor == 1.0),
        f"budget.machine_factor={b.machine_factor}: must be > 0, and other than 1 only with "
        "calibrated times (budget.step_seconds > 0), which it relates to this machine.",
    )
    _require(
        not calibrated or b.device_hours > 0,
        f"budget.step_seconds={b.step_seconds} needs budget.device_hours > 0 (the "
        "budget it divides); set both, or neither.",
    )
    if b.device_hours > 0 and not calibrated:
        _positive("budget", b, "measure_steps")
        first = BUDGET_SKIP_STEPS + b.measure_steps
        _require(
            t.lr_decay == "constant" or t.warmup_steps >= first,
            f"budget.device_hours={b.device_hours} fixes the run length after step {first} "
            f"({BUDGET_SKIP_STEPS} + budget.measure_steps), but the decay starts at train.warmup_steps="
            f"{t.warmup_steps}; raise train.warmup_steps to >= {first} or lower budget.measure_steps.",
        )


def check_data(cfg: RunConfig) -> None:
    d = cfg.data
    if d.valid_prefix or d.split:  # the held-out set comes from elsewhere: the fraction is not used
        _require(
            0.0 <= d.valid_fraction < 1.0,
            f"data.valid_fraction={d.valid_fraction}: must lie in [0, 1) (it is not used with "
            f"{'data.valid_prefix' if d.valid_prefix else 'data.split'}).",
        )
    else:
        _require(
            0.0 < d.valid_fraction < 1.0,
            f"data.valid_fraction={d.valid_fraction}: must lie in (0, 1): the share of data.prefix's "
            "documents held out for validation (or give data.valid_prefix or data.split instead).",
        )
    _require(
        d.split_seed >= -1,
        f"data.split_seed={d.split_seed}: must be >= 0, or -1 to take train.seed.",
    )
    _require(
        0 <= d.eod_token < cfg.model.vocab_size, f"data.eod_token={d.eod_token}: outside the vocabulary."
    )
    _require(d.num_workers >= 0, f"data.num_workers={d.num_workers}: must be >= 0.")
    _check_heldout(d)
    # data.blend's syntax and the datasets themselves are checked by the preflight.


def parse_split(spec: str) -> tuple[float, float, float]:
    """``"969,30,1"`` (or ``"969/30/1"``, or fewer numbers: the rest are 0) -> normalised shares.

    Raises:
        ValueError: not numbers, a negative one, more than three, or all zero (names the value).
    """
    parts = [p.strip() for p in spec.replace("/", ",").split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"data.split={spec!r}: not numbers; write e.g. '969,30,1' (train,valid,test)"
        ) from None
    if len(shares) > 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"data.split={spec!r}: give up to three shares >= 0, not all 0, e.g. '969,30,1'")
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    return shares[0] / total, shares[1] / total, shares[2] / total


def _check_heldout(d) -> None:
    """data.split's syntax, and no two ways of choosing the held-out set at once."""
    if not d.split:
        return
    _require(
        not (d.valid_prefix or d.test_prefix or d.blend),
        f"data.split={d.split!r} cuts data.prefix's documents; it does not combine with "
        "data.valid_prefix / data.test_prefix / data.blend: remove one of them.",
    )
    try:
        shares = parse_split(d.split)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _require(
        shares[0] > 0 and shares[1] > 0,
        f"data.split={d.split!r}: the train and validation shares must be > 0, e.g. '969,30,1'.",
    )


def check_recompute(cfg: RunConfig) -> None:
    t = cfg.train
    _require(
        t.recompute in ("none", "selective", "full"),
        f"train.recompute='{t.recompute}': none, selective (the attention core only) or full (every block).",
    )
    _require(
        not (t.activation_checkpointing and t.recompute == "selective"),
        "train.activation_checkpointing=true means train.recompute=full, but train.recompute=selective; "
        "set train.activation_checkpointing=false to recompute the attention core only.",
    )


def check_compile(cfg: RunConfig) -> None:
    value = cfg.train.compile
    _require(
        isinstance(value, bool) or value == COMPILE_AUTO,
        f"train.compile={value!r}: use true, false or '{COMPILE_AUTO}' (on for CUDA, off on CPU).",
    )


def check_output(cfg: RunConfig) -> None:
    o = cfg.output
    _one_of(
        "output.lock",
        o.lock,
        ("auto", "lease"),
        " (lease: for file systems whose locks are not shared between nodes)",
    )
    _require(
        o.lease_timeout_seconds > 0 and o.lease_timeout_seconds != float("inf"),
        f"output.lease_timeout_seconds={o.lease_timeout_seconds}: a positive number of seconds "
        "(default 120).",
    )


VALIDATORS: list[Callable[[RunConfig], None]] = [
    check_model,
    check_parallel,
    check_train,
    check_recompute,
    check_compile,
    check_data,
    check_output,
]


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """Data-parallel degree for ``world_size`` processes: world / (tp × pp).

    Raises:
        ConfigError: world size not divisible by tp × pp.
    """
    mp = cfg.parallel.tp_size * cfg.parallel.pp_size
    _require(
        world_size % mp == 0,
        f"world size {world_size} is not divisible by parallel.tp_size × parallel.pp_size = {mp}; "
        "launch a multiple of that many processes.",
    )
    return world_size // mp


def validate_layout(cfg: RunConfig, world_size: int) -> int:
    """Check the rules that need the world size; return the data-parallel size.

    Raises:
        ConfigError: global batch not divisible by micro batch × data-parallel size, or a world size
            that tp × pp does not divide.
    """
    dp = data_parallel_size(cfg, world_size)
    t = cfg.train
    _require(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size × "
        f"data-parallel size = {t.micro_batch_size} × {dp} = {t.micro_batch_size * dp}; "
        f"use a multiple of {t.micro_batch_size * dp}.",
    )
    return dp


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """The config as plain nested dicts (for YAML dumps, checkpoints and TensorBoard)."""
    return dataclasses.asdict(cfg)


def require_causal_lm(config: ModelConfig, checkpoint: str, what: str) -> None:
    """Refuse a masked-LM checkpoint where a causal LM is needed (sampling, next-token scoring,
    perplexity, the Hugging Face causal-LM export), before any model is built or process group made.

    Raises:
        ConfigError: ``config.objective`` is not ``clm``; the message names the checkpoint, its
            ``model.objective`` and ``what`` needs the causal LM.
    """
    _require(
        config.objective == "clm",
        f"{checkpoint}: the checkpoint's model.objective='{config.objective}' (a masked LM, bidirectional "
        f"attention): {what} needs a causal LM checkpoint (model.objective='clm').",
    )
