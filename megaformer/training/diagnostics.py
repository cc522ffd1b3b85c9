"""Training dynamics the NormFormer paper analyses (Shleifer et al. 2021, Sec. 4), and a run's health.

* :class:`StepHealth`: non-finite steps (a loss or gradient norm that is inf / NaN) counted on the
  device, fp16 overflow-skipped steps, and the optional divergence stop of the learning-rate
  stability test (:class:`DivergenceDetector`, the paper's Fig. 5).
* :class:`LayerDiagnostics`: every ``train.diagnostics_interval`` steps, per decoder layer

  - ``grads/fc2_l1/layer_NN``: the average L1 norm of FC2's weight gradient, ``Σ|g| / numel`` over
    the full (unsharded) weight (the paper's Fig. 3 and Fig. 7: "average L1 norm of the gradients to
    the second fully connected weight");
  - ``grads/l2/<op>/layer_NN``: the L2 norm of each operation's full gradient (its weight and bias
    together) for ``qkv``, ``out_proj``, ``fc1``, ``fc2``, every LayerNorm (``ln1``, ``ln2``,
    ``post_attn_ln``, ``ffn_ln``, ``qkv_ln``), ``head_scale`` and ``resid_scale``;
  - ``scales/<op>_mean/layer_NN`` and histograms ``scales/<op>/layer_NN`` of the learned scales
    (Fig. 4 and Fig. 6): ``ffn_ln`` gain, ``post_attn_ln`` gain, HeadScale ``head_scale`` γ and
    ResScale ``resid_scale`` λ;
  - ``train/param_norm``: the L2 norm of all parameters (every step, see :func:`param_norm_squared`).

Full-parameter figures at any layout: a TP-sharded parameter (``tensor_model_parallel``) adds its
slice's sums on every TP rank, a replicated one on TP rank 0 only; the per-layer sums are then
all-reduced over the TP group and over the pipeline group (each stage holds its own layers). Under
ZeRO a rank's ``param.grad`` is not the full gradient: it is assembled with DeepSpeed's
``safe_get_full_grad``, which must run after the backward pass and before the optimizer step; the
adapter calls :meth:`LayerDiagnostics.collect_grads` there (``Engine.before_optimizer_step``). In
fp16 the gradients are still multiplied by the loss scale at that moment; they are divided by it.

Everything is reduced on the device into one vector; nothing is read to the host here (the loop's
:class:`~megaformer.training.metrics.DeferredScalars` reads it with the other scalars).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from megaformer.model.normformer import NormFormerBlock
from megaformer.parallel.comm import comm_device
from megaformer.training.ds_adapter import full_grad, is_pipe_replica

GRAD_OPS = (
    "qkv",
    "out_proj",
    "fc1",
    "fc2",
    "ln1",
    "ln2",
    "post_attn_ln",
    "ffn_ln",
    "qkv_ln",
    "head_scale",
    "resid_scale",
)
"""Submodules / parameters of a :class:`~megaformer.model.normformer.NormFormerBlock` whose gradient
norm is logged (those a scheme does not have are skipped)."""

SCALE_OPS = {
    "ffn_ln": "ffn_ln.weight",
    "post_attn_ln": "post_attn_ln.weight",
    "head_scale": "head_scale",
    "resid_scale": "resid_scale",
}
"""The learned scales of the paper's Fig. 4 / Fig. 6: op name -> parameter name in the block."""
_SHARDED_SCALES = ("ffn_ln", "head_scale")  # split across the TP group (the others replicated)


def sharded_scales(config: Any) -> tuple[str, ...]:
    """The learned-scale ops split across the TP group under ``config``: FFN_LN's gain, and HeadScale's
    γ unless it acts after W_O (``head_scale_position='after_out_proj'``: replicated)."""
    if getattr(config, "head_scale_position", "before_out_proj") == "after_out_proj":
        return tuple(op for op in _SHARDED_SCALES if op != "head_scale")
    return _SHARDED_SCALES


def layer_tag(prefix: str, layer: int) -> str:
    """``f"{prefix}/layer_{layer:02d}"`` (zero-padded so TensorBoard sorts layers in order)."""
    return f"{prefix}/layer_{layer:02d}"


def _blocks(module: torch.nn.Module) -> list[Any]:
    """The decoder blocks held by this rank (a pipeline stage holds some), by layer index."""

    return sorted(
        (m for m in module.modules() if isinstance(m, NormFormerBlock)), key=lambda m: m.layer_index
    )


def _op_params(block: Any, op: str) -> list[torch.nn.Parameter]:
    """The parameters of operation ``op`` of ``block`` (empty when the block has no such op)."""
    part = getattr(block, op, None)
    if part is None:
        return []
    if isinstance(part, torch.nn.Parameter):
        return [part]
    return list(part.parameters())


def _counts_here(param: torch.nn.Parameter, first_tp_rank: bool) -> bool:
    """Whether this rank adds ``param``'s sums: sharded ones on every TP rank, replicated on rank 0."""
    return first_tp_rank or bool(getattr(param, "tensor_model_parallel", False))


def ops_of(config: Any) -> tuple[list[str], list[str]]:
    """The gradient-norm ops and the learned-scale ops a model config has (the same on every rank,
    whichever layers a pipeline stage holds)."""
    switches = {op: bool(getattr(config, op, False)) for op in ("post_attn_ln", "ffn_ln", "qkv_ln")}
    switches.update(head_scale=config.head_scale, resid_scale=config.resid_scale)
    grads = [op for op in GRAD_OPS if switches.get(op, True)]
    scales = [op for op in SCALE_OPS if switches[op]]
    return grads, scales


class LayerDiagnostics:
    """Per-layer gradient norms and learned scales of this rank's model (see the module docstring).

    Args:
        module: this rank's model (the whole :class:`~megaformer.model.NormFormerLM`, or a stage).
        config: the :class:`~megaformer.config.schema.ModelConfig`.
        state: the job's :class:`~megaformer.parallel.state.ParallelState`.
        loss_scale: returns the fp16 loss scale the gradients carry now (None: unscaled).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: Any,
        state: Any,
        loss_scale: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.blocks = _blocks(module)
        self.num_layers = config.num_layers
        self.sharded_scales = sharded_scales(config)
        self.state = state
        self.loss_scale = loss_scale
        self.first_tp_rank = state.tp_rank == 0
        self.device = comm_device(state.split_tp_group)
        self.ops, self.scale_ops = ops_of(config)
        self._grads: torch.Tensor | None = None

    def _reduce(self, vector: torch.Tensor) -> torch.Tensor:
        """Sum ``vector`` over the TP group, then over the pipeline group (in place, on the device)."""
        s = self.state
        if s.tp_size > 1:
            dist.all_reduce(vector, group=s.tp_group)
        if s.pp_size > 1:
            dist.all_reduce(vector, group=s.pp_group)
        return vector

    def collect_grads(self) -> None:
        """Reduce this step's per-layer gradient sums (call after backward, before the optimizer
        step; a collective over TP, PP and, under ZeRO, DP). Kept until :meth:`grad_scalars`."""
        n_ops = len(self.ops)
        # One row per layer: [sum g^2 of each op ..., sum |g| of fc2.weight, numel of fc2.weight]
        sums = torch.zeros(self.num_layers, n_ops + 2, dtype=torch.float64, device=self.device)
        for block in self.blocks:
            row = sums[block.layer_index]
            for j, op in enumerate(self.ops):
                for p in _op_params(block, op):
                    g = full_grad(p)  # every DP rank calls it for every parameter (a collective)
                    if g is None or not _counts_here(p, self.first_tp_rank):
                        continue
                    g = g.detach().double()
                    row[j] += g.square().sum().to(self.device)
                    if p is block.fc2.weight:
                        row[n_ops] += g.abs().sum().to(self.device)
                        row[n_ops + 1] += g.numel()
        self._reduce(sums)
        scale = self.loss_scale()
        if scale is not None and scale != 1.0:  # fp16: the gradients still carry the loss scale
            sums[:, :n_ops] /= scale * scale
            sums[:, n_ops] /= scale
        self._grads = sums

    def grad_scalars(self) -> dict[str, torch.Tensor]:
        """The last :meth:`collect_grads`'s figures as 0-dim device tensors, by TensorBoard tag
        (empty when none was collected); clears them."""
        if self._grads is None:
            return {}
        sums, self._grads = self._grads, None
        n_ops = len(self.ops)
        out: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            row = sums[layer]
            out[layer_tag("grads/fc2_l1", layer)] = row[n_ops] / row[n_ops + 1].clamp(min=1)
            for j, op in enumerate(self.ops):
                out[layer_tag(f"grads/l2/{op}", layer)] = row[j].sqrt()
        return out

    def scale_means(self) -> dict[str, torch.Tensor]:
        """Per layer, the mean of each learned scale over the full parameter (sharded HeadScale
        gains summed over the TP group), 0-dim device tensors by tag ``scales/<op>_mean/layer_NN``.
        A collective over TP and PP."""
        n = len(self.scale_ops)
        if n == 0:
            return {}
        sums = torch.zeros(self.num_layers, 2 * n, dtype=torch.float64, device=self.device)
        for block in self.blocks:
            named = dict(block.named_parameters())
            for j, op in enumerate(self.scale_ops):
                p = named[SCALE_OPS[op]]
                if _counts_here(p, self.first_tp_rank):
                    sums[block.layer_index, j] += p.detach().double().sum().to(self.device)
                    sums[block.layer_index, n + j] += p.numel()
        self._reduce(sums)
        return {
            layer_tag(f"scales/{op}_mean", layer): sums[layer, j] / sums[layer, n + j].clamp(min=1)
            for layer in range(self.num_layers)
            for j, op in enumerate(self.scale_ops)
        }

    def scale_histograms(self) -> dict[str, torch.Tensor]:
        """Every layer's learned scales, whole (TP shards concatenated in rank order), as host
        float32 tensors by tag ``scales/<op>/layer_NN``; complete on global rank 0.

        Under TP or PP an object all-gather over the world (a host round trip, every diagnostics
        interval only; the values are a few thousand floats).
        """
        local: dict[str, torch.Tensor] = {}
        for block in self.blocks:
            named = dict(block.named_parameters())
            for op in self.scale_ops:
                value = named[SCALE_OPS[op]].detach().float().cpu()
                local[layer_tag(f"scales/{op}", block.layer_index)] = value
        s = self.state
        if s.tp_size == 1 and s.pp_size == 1:
            return local
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (s.tp_rank, s.dp_rank, local))
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for tp_rank, dp_rank, values in gathered:
            if dp_rank != 0:  # data-parallel replicas hold the same values
                continue
            for tag, v in values.items():
                parts.setdefault(tag, {})[tp_rank] = v
        out = {}
        for tag, by_rank in parts.items():
            # HeadScale's (before W_O) and FFN_LN's gains are sharded over TP; POSTATTN_LN's, λ and
            # an after-W_O HeadScale's replicated.
            sharded = tag.split("/")[1] in self.sharded_scales
            out[tag] = torch.cat([by_rank[r] for r in sorted(by_rank)]) if sharded else by_rank[0]
        return out


def param_norm_squared(module: torch.nn.Module, state: Any) -> torch.Tensor:
    """Squared L2 norm of all the model's parameters (every TP shard and stage; the pipeline's
    tied-embedding copy on the last stage counted once), fp32 on the communication device.

    Under ZeRO-3 a rank holds parameter partitions, not parameters: the norm is then not the
    model's (not gathered; a known limitation, as for the learned scales)."""
    device = comm_device(state.split_tp_group)
    first = state.tp_rank == 0
    params = [
        p.detach()
        for p in module.parameters()
        if p.numel() > 0 and not is_pipe_replica(p) and _counts_here(p, first)
    ]
    total = torch.zeros((), dtype=torch.float32, device=device)
    if params:  # one fused kernel per device and dtype rather than one per parameter
        norms = torch._foreach_norm(params, 2, dtype=torch.float32)  # bf16/fp16 summed in fp32
        total += torch.stack([n.float().to(device) for n in norms]).square().sum()
    if state.tp_size > 1:
        dist.all_reduce(total, group=state.tp_group)
    if state.pp_size > 1:
        dist.all_reduce(total, group=state.pp_group)
    return total


def _finite_flag(values: Iterable[Any], device: torch.device) -> torch.Tensor:
    """1 (int64, on ``device``) when any of ``values`` (tensors or numbers; None skipped) is not
    finite, else 0. No host read for tensors."""
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for v in values:
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            bad = bad | ~torch.isfinite(v.detach().to(device)).all()
        elif not math.isfinite(float(v)):
            bad = torch.ones((), dtype=torch.bool, device=device)
    return bad.to(torch.int64)


class DivergenceDetector:
    """The learning-rate stability test's stop rule (Shleifer et al. 2021, Fig. 5).

    A step diverges when its training loss is not finite, or exceeds ``factor`` times the lowest
    loss seen so far in the run. Reads the loss to the host every step (a device sync): used only
    when ``train.divergence_factor`` > 0.
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.running_min = math.inf

    def diverged(self, loss: float) -> bool:
        """Whether ``loss`` (nats/token) diverges; otherwise it updates the running minimum."""
        if not math.isfinite(loss):
            return True
        if loss > self.factor * self.running_min:
            return True
        self.running_min = min(self.running_min, loss)
        return False


class StepHealth:
    """Counts, on the device, the steps whose loss or gradient norm is not finite, and reads the
    optimizer steps DeepSpeed skipped; applies the divergence stop when ``train.divergence_factor``
    > 0.

    DeepSpeed skips an update whose gradients are not finite under fp16 (an overflow: the loss scale
    is lowered) and under ZeRO (its overflow check), counted in ``train/skipped_steps``; without
    either, the non-finite update is applied. Under fp16 a non-finite gradient is the loss scaler's
    routine signal, so only the loss counts as non-finite there.

    Args:
        engine: the :class:`~megaformer.training.ds_adapter.Engine`.
        device: where the count lives (the loss's device).
        fp16: the run is in fp16.
        divergence_factor: see :class:`DivergenceDetector` (0: never stop).
    """

    def __init__(self, engine: Any, device: torch.device, fp16: bool, divergence_factor: float) -> None:
        self.engine = engine
        self.fp16 = fp16
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.reported = 0  # non-finite steps already announced on the console
        self.detector = DivergenceDetector(divergence_factor) if divergence_factor > 0 else None

    def step(self, loss: torch.Tensor, grad_norm: Any) -> dict[str, Any]:
        """Account for one step; returns its scalars (``train/nonfinite_steps`` as a device tensor,
        ``train/skipped_steps`` so far, a host int)."""
        checked = [loss] if self.fp16 else [loss, grad_norm]
        self.count = self.count + _finite_flag(checked, self.count.device)
        return {"train/nonfinite_steps": self.count, "train/skipped_steps": self.engine.skipped_steps()}

    def diverged(self, loss: torch.Tensor) -> bool:
        """Whether the divergence stop fires at this step (reads the loss: a device sync; always
        False when the stop is off). The loss is the same on every rank, so every rank decides alike."""
        return self.detector is not None and self.detector.diverged(float(loss))

    def announce(self, values: dict[str, float | None]) -> str | None:
        """A console warning when the count in a flushed line grew since the last one, else None."""
        count = int(values.get("train/nonfinite_steps") or 0)
        if count <= self.reported:
            return None
        new, self.reported = count - self.reported, count
        skipped = int(values.get("train/skipped_steps") or 0)
        return (
            f"warning: {new} more step(s) with a non-finite loss or gradient norm ({count} in all, "
            f"TensorBoard train/nonfinite_steps; {skipped} updates skipped by DeepSpeed's overflow "
            "check so far, train/skipped_steps; a non-finite update that was not skipped leaves inf/NaN "
            "weights). Lower train.lr, set train.grad_clip > 0, or resume from an earlier checkpoint"
        )
