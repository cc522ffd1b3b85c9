"""Runs of one comparison that differ only in their seed: grouped, and summarised over seeds.

``compare`` takes every run as its own config; when several differ only in ``train.seed`` (the
issue's "at least three seeds" per scheme), the final validation loss is reported per group as
mean ± sample standard deviation over seeds, and against the baseline's group as paired
differences: run minus the baseline's run of the same seed, which share the data order and the
held-out documents, so that what the seeds change in both cancels.
"""

from __future__ import annotations

import json
import re
import statistics
from typing import Any

_SEED_SUFFIX = re.compile(r"[-_.]*(s|seed)?[-_.]*\d*$")


def _without_seed(resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved config (``megaformer.config.to_dict``) less what names a run rather than what it
    computes: ``train.seed`` and the ``output`` section."""
    out = {k: v for k, v in resolved.items() if k != "output"}
    out["train"] = {k: v for k, v in resolved["train"].items() if k != "seed"}
    return out


def group_label(names: list[str]) -> str:
    """A group's name: its runs' common prefix less a trailing seed marker (``pre_ln_s1234`` and
    ``pre_ln_s5678`` give ``pre_ln``, seeds 1234 and 1235 too); the first run's name when that
    leaves nothing."""
    if len(names) == 1:
        return names[0]
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    label = _SEED_SUFFIX.sub("", prefix)
    return label or names[0]


def seed_groups(resolved: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """``{label: [run, ...]}``: runs (in the given order) whose resolved configs are equal but for
    ``train.seed`` (and ``output.*``); a run with no such sibling is a group of one."""
    keys: dict[str, list[str]] = {}
    for name, cfg in resolved.items():
        keys.setdefault(json.dumps(_without_seed(cfg), sort_keys=True), []).append(name)
    groups: dict[str, list[str]] = {}
    for members in keys.values():
        label, k = group_label(members), 1
        while label in groups or (label in resolved and label not in members):
            k += 1  # e.g. a group "pre_ln" of pre_ln_s1/_s2 and a single run named "pre_ln"
            label = f"{group_label(members)}#{k}"
        groups[label] = members
    return groups


def _spread(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def seed_summary(
    rows: list[dict], groups: dict[str, list[str]], seeds: dict[str, int], split_seeds: dict[str, int]
) -> list[dict]:
    """One record per group, the baseline's group (that of ``rows[0]``) first.

    Args:
        rows: :func:`~.compare.comparison_rows` (``run``, ``final_valid_loss``, ``steps``,
            ``share_of_baseline_compute``).
        groups: :func:`seed_groups`.
        seeds: each run's ``train.seed``.
        split_seeds: each run's seed of the held-out documents (``RunConfig.split_seed``).

    Returns:
        Per group: ``group``, ``runs``, ``seeds``, ``n``; ``final_valid_loss_mean`` / ``_std``
        (nats; std None for one run) / ``_min`` / ``_max``; ``steps_mean``; ``share_mean`` (mean
        share of the baseline's compute; None when a run never reached the baseline's best);
        ``same_heldout`` (all runs evaluated on the same documents); ``paired`` (``n``, ``mean``,
        ``std`` of this run minus the baseline group's run of the same seed, None without a pair).
        A run whose loss is None (diverged) leaves the group's loss figures None.
    """
    by_run = {r["run"]: r for r in rows}
    base_group = next(g for g, members in groups.items() if rows[0]["run"] in members)
    base_seeds = [seeds[n] for n in groups[base_group]]
    # a seed the baseline's group holds twice (the same config listed twice, an A/A comparison)
    # has no single partner: it is left out of the pairs
    base_by_seed = {seeds[n]: n for n in groups[base_group] if base_seeds.count(seeds[n]) == 1}
    out = []
    for label in [base_group, *[g for g in groups if g != base_group]]:
        members = groups[label]
        losses = [by_run[n]["final_valid_loss"] for n in members]
        shares = [by_run[n]["share_of_baseline_compute"] for n in members]
        record: dict[str, Any] = {
            "group": label,
            "runs": members,
            "seeds": [seeds[n] for n in members],
            "n": len(members),
            "steps_mean": statistics.fmean(by_run[n]["steps"] for n in members),
            "share_mean": None if None in shares else statistics.fmean(shares),
            "same_heldout": len({split_seeds[n] for n in members}) == 1,
            "final_valid_loss_mean": None,
            "final_valid_loss_std": None,
            "final_valid_loss_min": None,
            "final_valid_loss_max": None,
            "paired": None,
        }
        if None not in losses:
            mean, std = _spread(losses)
            record |= {"final_valid_loss_mean": mean, "final_valid_loss_std": std}
            record |= {"final_valid_loss_min": min(losses), "final_valid_loss_max": max(losses)}
        pairs = [
            by_run[n]["final_valid_loss"] - by_run[base_by_seed[seeds[n]]]["final_valid_loss"]
            for n in members
            if seeds[n] in base_by_seed
            and split_seeds[n] == split_seeds[base_by_seed[seeds[n]]]
            and by_run[n]["final_valid_loss"] is not None
            and by_run[base_by_seed[seeds[n]]]["final_valid_loss"] is not None
        ]
        if label != base_group and pairs:
            mean, std = _spread(pairs)
            record["paired"] = {"n": len(pairs), "mean": mean, "std": std}
        out.append(record)
    return out


def _pm(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    if mean is None:
        return "—"
    return f"{mean:{spec}}" if std is None else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


def seed_table(summary: list[dict]) -> str:
    """:func:`seed_summary` as a Markdown table (empty when every group holds one run)."""
    if all(g["n"] == 1 for g in summary):
        return ""
    base = summary[0]["group"]
    lines = [
        "Over seeds (mean ± sample standard deviation; paired: this run minus the baseline's run of "
        f"the same seed, {base}):",
        "",
        "| group | seeds | final valid loss | min – max | paired difference vs baseline | mean steps "
        "| mean share of the baseline's compute |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in summary:
        span = (
            "—"
            if g["final_valid_loss_min"] is None
            else f"{g['final_valid_loss_min']:.4f} – {g['final_valid_loss_max']:.4f}"
        )
        paired = g["paired"]
        diff = "—" if paired is None else f"{_pm(paired['mean'], paired['std'], '+.4f')} (n = {paired['n']})"
        share = "—" if g["share_mean"] is None else f"{g['share_mean']:.0%}"
        lines.append(
            f"| {g['group']} | {', '.join(map(str, g['seeds']))} | "
            f"{_pm(g['final_valid_loss_mean'], g['final_valid_loss_std'])} | {span} | {diff} | "
            f"{g['steps_mean']:,.0f} | {share} |"
        )
    if not all(g["same_heldout"] for g in summary):
        lines += [
            "",
            "Each seed held out other documents (data.split_seed unset): a group's spread includes "
            "the held-out documents' difficulty; the paired differences do not.",
        ]
    return "\n".join(lines) + "\n"
