"""The memory / throughput planner (python -m megaformer.tools.plan): its parameter counts are the
model's, its activation coefficients are the ones measured on the block, every shipped recipe's
layout fits the devices its header names (the recipes follow the planner), and it suggests a
layout that fits where a config does not."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megaformer.config import load_config
from megaformer.model import NormFormerLM, count_parameters
from megaformer.perf import plan as planner
from megaformer.tools import plan as plan_command
from tests.unit.test_recipes import MLM_RECIPES, RECIPES, ZERO2_A100, _header, _layouts, _path

GIB = 1024**3


@pytest.mark.parametrize("name", ["125m-baseline", "355m-normformer", "1.3b-normformer", "2.7b-baseline"])
def test_parameter_counts_are_the_models(name):
    cfg = load_config(_path(name))
    with torch.device("meta"):
        n = count_parameters(NormFormerLM(cfg.model))
    counts = planner.layer_param_counts(cfg.model, 1)
    assert sum(counts[:-1]) == n  # the tied output projection is the embedding itself
    # at tp 2 the sharded matrices halve and the replicated vectors do not
    half = planner.layer_param_counts(cfg.model, 2)
    assert half[1] < counts[1] / 2 + 10 * cfg.model.hidden_size


@pytest.mark.parametrize(("nf", "coefficient"), [(False, 36), (True, 48)])
def test_block_activations_are_the_measured_coefficients(nf, coefficient):
    """test_recipes.py measures what a bf16 block keeps (36 / 48 bytes per token and unit of width)."""
    overrides = ["train.micro_batch_size=1", "model.hidden_dropout=0.1", "model.resid_scale=false"]
    cfg = load_config(_path("355m-normformer" if nf else "355m-baseline"), overrides)
    got = planner.block_activation_bytes(cfg, planner.DEVICES["a100-80gb"])
    per = cfg.model.seq_len * cfg.model.hidden_size
    assert got == coefficient * per
    selective = planner.block_activation_bytes(cfg, planner.DEVICES["a100-80gb"], "selective")
    full = planner.block_activation_bytes(cfg, planner.DEVICES["a100-80gb"], "full")
    assert full == 2 * per < selective == (coefficient - 2) * per


@pytest.mark.parametrize("hw", ["A100", "V100"])
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_layout_fits_the_device_its_header_names(name, hw):
    world, overrides, _, _ = _layouts(name)[hw]
    cfg = load_config(_path(name), overrides)
    device = planner.DEVICES["a100-80gb" if hw == "A100" else "v100-32gb"]
    plan = planner.make_plan(cfg, device, world)
    assert plan.fits, planner.describe(plan)


@pytest.mark.parametrize("hw", ["A100", "V100"])
@pytest.mark.parametrize("name", RECIPES + MLM_RECIPES)
def test_every_recipe_layout_is_the_planners_choice(name, hw):
    """Issue 19: data parallelism, no recompute, and the largest micro-batch that fits the header's
    device: the next micro-batch that divides the batch per rank does not fit."""
    world, overrides, micro, ckpt = _layouts(name)[hw]
    cfg = load_config(_path(name), overrides)
    device = planner.DEVICES["a100-80gb" if hw == "A100" else "v100-32gb"]
    assert (cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.train.recompute_mode) == (1, 1, "none")
    assert not ckpt and planner.make_plan(cfg, device, world).fits
    per_rank = cfg.train.global_batch_size // world
    bigger = [m for m in range(micro + 1, per_rank + 1) if per_rank % m == 0]
    if bigger:
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=bigger[0]))
        assert not planner.make_plan(trial, device, world).fits, f"{name} {hw}: micro-batch {bigger[0]} fits"


@pytest.mark.slow  # the step-time model's block traces at full size (4-9 s each on 2 cores)
@pytest.mark.parametrize("name", ZERO2_A100)
def test_a_zero2_recipe_layout_is_the_faster_stage_as_its_header_says(name):
    """The A100 layouts that are ZeRO-2 (the planner's memory search prefers ZeRO-1 at equal size):
    the step-time model predicts a shorter step than ZeRO-1 at ZeRO-1's own largest fitting
    micro-batch, at the recipe's world, and the header quotes both steps (python -m
    megaformer.tools.plan FILE --gpu a100-80gb --nodes N --predict, with train.zero_stage=1)."""
    from megaformer.perf import steptime

    world, _, micro, _ = _layouts(name)["A100"]
    cfg = load_config(_path(name))
    device, spec = planner.DEVICES["a100-80gb"], steptime.DEVICE_SPECS["a100-80gb"]
    assert cfg.train.zero_stage == 2 and planner.make_plan(cfg, device, world).fits
    zero1 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, zero_stage=1))
    per_rank = cfg.train.global_batch_size // world
    fitting = [
        m
        for m in range(1, per_rank + 1)
        if per_rank % m == 0
        and planner.make_plan(
            dataclasses.replace(zero1, train=dataclasses.replace(zero1.train, micro_batch_size=m)),
            device,
            world,
        ).fits
    ]
    zero1 = dataclasses.replace(zero1, train=dataclasses.replace(zero1.train, micro_batch_size=max(fitting)))
    assert max(fitting) <= micro
    t2 = steptime.predict(cfg, spec, world, 8).total
    t1 = steptime.predict(zero1, spec, world, 8).total
    assert t2 < 0.95 * t1, (name, t2, t1)
    stated = re.search(r"([\d.]+) s with ZeRO-2 against ([\d.]+) s\s+(?:# )?\s*with ZeRO-1", _header(name))
    assert stated, f"{name}: no predicted steps in the header"
    assert (float(stated[1]), float(stated[2])) == (
        pytest.approx(t2, abs=0.005),
        pytest.approx(t1, abs=0.005),
    )


@pytest.mark.parametrize(
    ("path", "gpu", "world"),
    [
        ("configs/normformer-1.3b-3d-v100.yaml", "v100-32gb", 256),
        ("configs/normformer-2.7b-3d-a100.yaml", "a100-80gb", 256),
        ("configs/normformer-350m-zero2.yaml", "a100-80gb", 8),
    ],
)
def test_3d_layouts_fit(path, gpu, world):
    cfg = load_config(path)
    plan = planner.make_plan(cfg, planner.DEVICES[gpu], world)
    assert plan.fits, planner.describe(plan)


def test_a_layout_that_does_not_fit_gets_a_suggestion_that_does():
    cfg = load_config(_path("2.7b-normformer"), ["train.micro_batch_size=16"])
    device = planner.DEVICES["v100-32gb"]
    assert not planner.make_plan(dataclasses.replace(cfg), device, 8).fits
    alt = planner.suggest_layout(cfg, device, 8, gpus_per_node=8)
    assert alt is not None and alt.fits and alt.peak <= 0.8 * 32 * GIB
    assert alt.cfg.model == cfg.model and alt.cfg.train.global_batch_size == cfg.train.global_batch_size


def test_command_prints_memory_flops_time_and_the_recipe_devices(capsys):
    rc = plan_command.main(
        [_path("1.3b-normformer"), "--gpu", "a100-80gb", "--nodes", "2", "--gpus-per-node", "8"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "fits" in out and "device-hours" in out and "model FLOPs per step" in out
    for name in ("V100-SXM2-32GB", "A100-SXM4-40GB", "A100-SXM4-80GB"):
        assert name in out
    # 286,102 steps of 1M tokens at 9.5e15 FLOPs per step, 16 A100s at 40 % MFU
    plan = planner.make_plan(load_config(_path("1.3b-normformer")), planner.DEVICES["a100-80gb"], 16)
    assert plan.step_time_s == pytest.approx(plan.flops_per_step / (16 * 312e12 * 0.4))


def test_gpu_aliases_are_accepted_and_an_unknown_one_is_named(capsys):
    """``--gpu h100`` is what users type (issue 23): the aliases of the dry run, any case."""
    assert (
        plan_command.main([_path("125m-baseline"), "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "8"])
        == 0
    )
    assert "H100-SXM5-80GB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_command.main([_path("125m-baseline"), "--gpu", "h1000"])
    err = capsys.readouterr().err
    assert "unknown GPU 'h1000'" in err and "h100-80gb" in err and "(or v100, a100" in err


def test_predict_prints_one_device_hours_figure_the_prediction(capsys):
    """Issue 36: ``plan --predict`` printed 6,072 device-hours at an assumed 40 % MFU beside the
    model's figure; with --predict it prints one, labelled a prediction, and no assumed MFU."""
    args = [_path("1.3b-normformer"), "--gpu", "a100", "--nodes", "2", "--gpus-per-node", "8", "--predict"]
    assert plan_command.main(args + ["--counts", "formula"]) == 0
    out = capsys.readouterr().out
    assert out.count("device-hours") == 1 and "assumed MFU" not in out
    line = next(x for x in out.splitlines() if "device-hours" in x)
    assert line.startswith("predicted:") and "a prediction" in out
    assert plan_command.main(args[:-1]) == 0  # without --predict: the assumed-MFU figure, named so
    out = capsys.readouterr().out
    assert out.count("device-hours") == 1 and "at an assumed MFU of 40%" in out


@pytest.mark.parametrize("device", ["a100-40gb", "v100-32gb"])
@pytest.mark.parametrize("name", RECIPES + MLM_RECIPES)
def test_the_suggested_layout_for_another_device_is_the_recipe_headers(name, device):
    """Issue 36: plan suggested an A100-40GB layout for the 1.3B recipe (ZeRO-1, micro-batch 2) that
    was not its header's (ZeRO-2, micro-batch 4), which it also found to fit. Where a header names a
    layout for the device and it fits, that is the suggestion."""
    extra = planner.header_layout(_path(name), device)
    assert extra, f"{name}: no header line for {device}"
    world = _layouts(name)["A100" if device.startswith("a100") else "V100"][0]
    how, header, found = planner.recipe_layout(_path(name), [], device, world, 8)
    assert how == "header" and header.fits and found is not None and found.fits


def test_the_1_3b_a100_40gb_line_names_the_headers_layout(capsys):
    args = [_path("1.3b-normformer"), "--gpu", "a100", "--nodes", "2", "--gpus-per-node", "8"]
    plan_command.main(args)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("A100-SXM4-40GB"))
    assert "the recipe header's layout fits: add train.micro_batch_size=4 (peak 28.4 GiB)" in line
    assert "suggested" not in line
    # the planner's own search agrees now: it keeps the file's ZeRO-2 (its header says why)
    cfg = load_config(_path("1.3b-normformer"))
    found = planner.suggest_layout(cfg, planner.DEVICES["a100-40gb"], 16, 8)
    assert (found.cfg.train.zero_stage, found.cfg.train.micro_batch_size) == (2, 4)
