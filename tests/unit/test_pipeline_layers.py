"""Pipeline stages are cut from the model's one layer plan: a 2-stage ``PipelineModule`` built by
:func:`build_pipeline_module` holds NormFormerLM's parameters under the same names with the same
initial values (same seed), and its two stages compute NormFormerLM's loss and gradients; the
DeepSpeed specs are the plan entry for entry; activation checkpointing replays dropout."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch

from megaformer.config.schema import ModelConfig
from megaformer.model import NormFormerBlock, NormFormerLM, layer_prefixes, model_layers
from megaformer.parallel.rng import DropoutRNG
from megaformer.pipeline import (
    PARTITION_METHODS,
    build_pipeline_module,
    checkpointed,
    layer_specs,
    vocab_param_names,
)

TINY = ModelConfig(vocab_size=97, make_vocab_size_divisible_by=16, hidden_size=32, num_layers=3,
                   num_attention_heads=4, seq_len=16, resid_scale=True)  # fmt: skip


def _batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    return tokens, labels


@contextlib.contextmanager
def _as_rank(rank: int, world_size: int) -> Iterator[None]:
    """This process posing as ``rank`` of a ``world_size`` world: torch's "fake" backend (a
    single-process stand-in whose collectives do nothing), so a ``PipelineModule`` builds that
    rank's stage without the other processes. Only stage construction runs under it."""
    import deepspeed
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"  # PipelineModule moves its stage to this rank's device
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm over that group
        yield
    finally:
        dist.destroy_process_group()
        if old is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = old


def _two_stages(config: ModelConfig, seed: int, partition_method: str) -> list[torch.nn.Module]:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    stages = []
    for rank in (0, 1):
        # no_grad: autograd would record the tied-weight broadcast DeepSpeed runs at construction
        # (c10d has no autograd kernel for it: a warning at every backward through that weight).
        with _as_rank(rank, 2), torch.no_grad():
            stages.append(
                build_pipeline_module(
                    config,
                    topology=PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1),
                    tp_group=None,
                    seed=seed,
                    partition_method=partition_method,
                )
            )
    return stages


@pytest.mark.parametrize("partition_method", PARTITION_METHODS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipeline_stages_hold_the_model_s_parameters_and_compute_its_loss(tied, partition_method):
    config = dataclasses.replace(TINY, tie_embeddings=tied, position_embedding="learned")
    _check_stages_against_the_model(config, partition_method)


NF_OFF = dict(post_attn_ln=False, head_scale=False, ffn_ln=False, resid_scale=False)


@pytest.mark.parametrize(
    "scheme",
    [dict(norm_scheme="post_ln", **NF_OFF), dict(norm_scheme="deepnorm", **NF_OFF), dict(qkv_ln=True)],
    ids=["post_ln", "deepnorm", "qkv_ln"],
)
def test_pipeline_stages_of_every_norm_scheme_compute_the_model_s_loss(scheme):
    """Post-LN / DeepNorm have a FinalNorm without parameters; qkv_ln adds parameters to each block.
    (The default partition method, the one that weighs layers by their parameter counts.)"""
    config = dataclasses.replace(TINY, position_embedding="learned", **scheme)
    _check_stages_against_the_model(config, "parameters")


def _check_stages_against_the_model(config: ModelConfig, partition_method: str) -> None:
    tied = config.tie_embeddings
    model = NormFormerLM(config, seed=11)
    reference = dict(model.named_parameters())
    stages = _two_stages(config, 11, partition_method)
    seen: set[str] = set()
    for stage in stages:
        names = [n for n, _ in stage.named_parameters()]
        assert names and names == [n for n in reference if n in set(names)]  # same names, same order
        for name, p in stage.named_parameters():
            assert torch.equal(p, reference[name]), name  # the same seed: bitwise the same init
        seen |= set(names)
    assert seen == set(reference)  # together the stages hold the whole model, nothing else
    # The tied embedding lives on the first stage, and on the last one too when it projects.
    assert ("tied_modules.embed.token.weight" in dict(stages[1].named_parameters())) == tied

    tokens, labels = _batch(config)
    hidden = stages[0](tokens)
    loss = stages[1].loss_fn(stages[1](hidden), labels)
    ref = model(tokens, labels)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)  # the same functions in the same order
    loss.backward()
    ref.backward()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:  # the pipeline engine all-reduces the tied copies' gradients: a sum
        for name, p in stage.named_parameters():
            if p.grad is None:  # the last stage's copy of the learned positions: unused there
                assert name == "tied_modules.embed.position" and stage is stages[1], name
                continue
            grads[name] = grads[name] + p.grad if name in grads else p.grad
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_specs_are_the_plan_entry_for_entry():
    """The plan is the only listing: the pipeline's specs and NormFormerLM's modules derive from it."""
    rng = DropoutRNG(1)
    for config in (TINY, dataclasses.replace(TINY, tie_embeddings=False)):
        plan = model_layers(config, seed=5, dropout_rng=rng)
        specs = layer_specs(config, seed=5, dropout_rng=rng)
        assert len(specs) == len(plan) == config.num_layers + 3
        for layer, spec in zip(plan, specs, strict=True):
            assert spec.typename is layer.module
            assert spec.module_args == layer.args and spec.module_kwargs == dict(layer.kwargs)
            assert getattr(spec, "key", None) == layer.tied_key
            assert getattr(spec, "forward_fn", None) is layer.forward_fn
            if layer.tied_key is not None:
                assert spec.tied_weight_attr == [layer.tied_weight_attr]
        model = NormFormerLM(config, seed=5, dropout_rng=rng)
        registered = [f"tied_modules.{k}." for k in model.tied_modules]
        registered += [f"{name}." for name, _ in model.named_children() if name != "tied_modules"]
        assert registered == [p for p in layer_prefixes(plan) if p is not None]
        for layer, prefix in zip(plan, layer_prefixes(plan), strict=True):
            if prefix is not None:
                assert type(model.get_submodule(prefix.rstrip("."))) is layer.module
        # "type:NormFormerBlock" balances the stages on exactly the blocks.
        assert [i for i, s in enumerate(specs) if s.typename is NormFormerBlock] == list(
            range(1, config.num_layers + 1)
        )


def test_tied_plan_shares_one_embedding_and_names_follow_the_pipeline_module():
    model = NormFormerLM(TINY, seed=1)
    assert len(model.tied_modules) == 1
    # embedding (tied) + 3 blocks + final norm; the tied output reuses the embedding's weight
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"tied_modules", "1", "2", "3", "4"}
    assert vocab_param_names(TINY) == ("tied_modules.embed.token.weight",)
    untied = dataclasses.replace(TINY, tie_embeddings=False)
    model = NormFormerLM(untied, seed=1)
    assert vocab_param_names(untied) == ("tied_modules.embed.token.weight", "5.proj.weight")
    assert set(vocab_param_names(untied)) <= {n for n, _ in model.named_parameters()}


def test_activation_checkpointing_gives_the_same_loss_and_gradients_with_dropout():
    """Recomputed blocks replay the DropoutRNG states, so the masks (and gradients) are the same."""
    config = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels = _batch(config)
    results = []
    for ac in (False, True):
        rng = DropoutRNG(5)
        model = NormFormerLM(config, seed=3, dropout_rng=rng, checkpoint_fn=checkpointed(rng) if ac else None)
        loss = model(tokens, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for a, b in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
