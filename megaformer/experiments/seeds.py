"""Runs of one comparison that differ only in their seed: grouped, and summarised over seeds.

``compare`` takes every run as its own config; when several differ only in ``train.seed`` (the
issue's "at least three seeds" per scheme), the final validation loss is reported per group as
mean ± sample standard deviation over seeds, and against the baseline's group as paired
differences: run minus the baseline's run of the same seed, which share the data order and the
held-out documents, so that what the seeds change in both cancels. Each paired difference comes
with its statistics (:func:`paired_test`): the mean's 95 % t interval, the paired t-test's,
Wilcoxon signed-rank and sign test's two-sided p-values, and the pairs an 80 %-power t-test would
need at the observed spread for a stated effect (the paper's 125M gain by default,
:data:`PAPER_EFFECT`). None of the anchors (fairseq, Megatron-LM, GPT-NeoX, torchtitan) report
this; a comparison of one seed says it cannot be decided.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from typing import Any

PAPER_EFFECT = 0.036
"""Nats: NormFormer's gain over Pre-LN at 125M, compute-matched (Shleifer et al. 2021, Table 2:
21.09 → 20.34 validation perplexity, ln(21.09 / 20.34) = 0.036; + ResScale 20.11, 0.048)."""

POWER = 0.80
"""The power :func:`paired_test` sizes the number of seed pairs for."""

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


def power_of_paired_t(n: int, effect: float, sd: float, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` pairs, when the true mean
    difference is ``effect`` and the differences' standard deviation ``sd`` (noncentral t with
    ``n - 1`` degrees of freedom and noncentrality ``effect / (sd / sqrt(n))``; Cohen 1988, ch. 2).

    Raises:
        ValueError: ``n < 2`` or ``sd <= 0``.
    """
    from scipy import stats

    if n < 2 or sd <= 0:
        raise ValueError(f"power of a paired t-test needs n >= 2 pairs and sd > 0 (got n={n}, sd={sd})")
    df, nc = n - 1, abs(effect) / (sd / math.sqrt(n))
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def pairs_for_power(effect: float, sd: float, power: float = POWER, alpha: float = 0.05) -> int | None:
    """The fewest pairs (>= 2) whose paired t-test reaches ``power`` for ``effect`` at spread
    ``sd`` (:func:`power_of_paired_t`); None when ``sd`` is 0 or more than 100,000 would be needed."""
    if sd <= 0 or effect == 0:
        return None
    lo, hi = 2, 2
    while power_of_paired_t(hi, effect, sd, alpha) < power:
        lo, hi = hi, hi * 2
        if hi > 100_000:
            return None
    while lo < hi:  # power rises with n: the first n that reaches it
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power_of_paired_t(mid, effect, sd, alpha) < power else (lo, mid)
    return lo


def paired_test(diffs: list[float], effect: float = PAPER_EFFECT, alpha: float = 0.05) -> dict[str, Any]:
    """Statistics of paired differences (nats; one per seed: run minus the baseline's run of that
    seed).

    Args:
        diffs: the paired differences.
        effect: the effect (nats, its sign ignored) the number of pairs is sized for.
        alpha: the tests' level and 1 - the interval's coverage.

    Returns:
        ``n``, ``mean``, ``std`` (sample, n - 1), ``sem``; ``ci_low`` / ``ci_high`` (the mean's
        ``1 - alpha`` t interval), ``t``, ``p_t`` (paired t-test, two-sided), ``p_wilcoxon``
        (Wilcoxon signed-rank, exact for n <= 50 without ties, two-sided), ``p_sign`` (sign test:
        binomial on the signs, zeros dropped, two-sided), ``negative`` (how many are below 0),
        ``effect``, ``power`` (of this n's t-test for ``effect`` at the observed std) and
        ``pairs_for_power`` (pairs for :data:`POWER`); ``decidable`` False with a ``reason`` when
        there are fewer than 2 pairs or they do not vary (then the test figures are None).
    """
    from scipy import stats

    n = len(diffs)
    out: dict[str, Any] = {"n": n, "mean": statistics.fmean(diffs) if diffs else None, "effect": abs(effect)}
    keys = ("std", "sem", "ci_low", "ci_high", "t", "p_t", "p_wilcoxon", "p_sign", "power", "pairs_for_power")
    out |= dict.fromkeys(keys)
    out["negative"] = sum(d < 0 for d in diffs)
    std = statistics.stdev(diffs) if n > 1 else 0.0
    if n < 2 or std == 0:
        why = "one seed pair: the comparison cannot be decided" if n < 2 else "the differences do not vary"
        return out | {"decidable": False, "reason": why if n else "no seed pairs"}
    sem = std / math.sqrt(n)
    half = stats.t.ppf(1 - alpha / 2, n - 1) * sem
    t = out["mean"] / sem
    nonzero = [d for d in diffs if d != 0]
    sign = stats.binomtest(sum(d < 0 for d in nonzero), len(nonzero)).pvalue if nonzero else 1.0
    out |= {
        "std": std,
        "sem": sem,
        "ci_low": out["mean"] - half,
        "ci_high": out["mean"] + half,
        "t": t,
        "p_t": float(2 * stats.t.sf(abs(t), n - 1)),
        "p_wilcoxon": float(stats.wilcoxon(diffs).pvalue),
        "p_sign": float(sign),
        "power": power_of_paired_t(n, effect, std, alpha) if effect else None,
        "pairs_for_power": pairs_for_power(effect, std, POWER, alpha),
        "decidable": True,
        "reason": "",
    }
    return out


def seed_summary(
    rows: list[dict],
    groups: dict[str, list[str]],
    seeds: dict[str, int],
    split_seeds: dict[str, int],
    effect: float = PAPER_EFFECT,
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
        ``std`` of this run minus the baseline group's run of the same seed, and the statistics of
        :func:`paired_test` for ``effect``; None without a pair). A run whose loss is None
        (diverged) leaves the group's loss figures None.
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
            record["paired"] = paired_test(pairs, effect)
        out.append(record)
    return out


def _pm(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    if mean is None:
        return "—"
    return f"{mean:{spec}}" if std is None else f"{mean:{spec}} ± {std:{spec.lstrip('+')}}"


def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def paired_cells(paired: dict | None) -> tuple[str, str, str]:
    """The seed table's statistics cells of a :func:`paired_test` record: the mean difference ±
    std (n) with its 95 % interval, the p-values, the pairs for 80 % power (or why not)."""
    if paired is None:
        return "—", "—", "—"
    diff = f"{_pm(paired['mean'], paired['std'], '+.4f')} (n = {paired['n']})"
    if not paired["decidable"]:
        return diff, paired["reason"], "—"
    diff += f"; 95 % CI [{paired['ci_low']:+.4f}, {paired['ci_high']:+.4f}]"
    p = f"{_p(paired['p_t'])} / {_p(paired['p_wilcoxon'])} / {_p(paired['p_sign'])}"
    need = paired["pairs_for_power"]
    power = "—" if paired["power"] is None else f"{paired['power']:.0%}"
    return diff, p, f"{'—' if need is None else need} (now {power})"


def seed_table(summary: list[dict]) -> str:
    """:func:`seed_summary` as a Markdown table (empty when every group holds one run)."""
    if all(g["n"] == 1 for g in summary):
        return ""
    base = summary[0]["group"]
    effect = next((g["paired"]["effect"] for g in summary if g["paired"]), PAPER_EFFECT)
    lines = [
        "Over seeds (mean ± sample standard deviation; paired: this run minus the baseline's run of "
        f"the same seed, {base}; p: paired t-test / Wilcoxon signed-rank / sign test, two-sided; "
        f"power: of a paired t-test at α = 0.05 for an effect of {effect:g} nats at the observed "
        "spread):",
        "",
        "| group | seeds | final valid loss | min – max | paired difference vs baseline "
        f"| p (t / Wilcoxon / sign) | pairs for {POWER:.0%} power | mean steps "
        "| mean share of the baseline's compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary:
        span = (
            "—"
            if g["final_valid_loss_min"] is None
            else f"{g['final_valid_loss_min']:.4f} – {g['final_valid_loss_max']:.4f}"
        )
        diff, p, need = paired_cells(g["paired"])
        share = "—" if g["share_mean"] is None else f"{g['share_mean']:.0%}"
        lines.append(
            f"| {g['group']} | {', '.join(map(str, g['seeds']))} | "
            f"{_pm(g['final_valid_loss_mean'], g['final_valid_loss_std'])} | {span} | {diff} | {p} | "
            f"{need} | {g['steps_mean']:,.0f} | {share} |"
        )
    if not all(g["same_heldout"] for g in summary):
        lines += [
            "",
            "Each seed held out other documents (data.split_seed unset): a group's spread includes "
            "the held-out documents' difficulty; the paired differences do not.",
        ]
    return "\n".join(lines) + "\n"
