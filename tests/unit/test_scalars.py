"""A run's scalars in the compact committed form (``scalars.json.gz``) read back exactly as its
TensorBoard events, by ``compare.valid_curve``, ``plot`` and the reader itself (issue 36, item 6)."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from megaformer.experiments.compare import valid_curve
from megaformer.experiments.scalars import (
    COMPACT_FILE,
    ScalarsNotFoundError,
    main,
    read_compact,
    read_events,
    read_scalars,
    write_compact,
)
from megaformer.tools.plot import main as plot_main


def _write_events(run_dir) -> None:
    """A small run's events as ``megaformer.train`` logs them (through torch's SummaryWriter):
    per-step training scalars, evaluations every 5 steps, ``*-vs-tokens`` copies, values that are
    not round in decimal (1/3, 0.1), and one histogram."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for step in range(1, 21):
        tokens = 512 * step
        loss = 10.0 / step + 1.0 / 3.0
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/loss-vs-tokens", loss, tokens)
        writer.add_scalar("train/device_hours", step * 0.1 / 3600, step)
        writer.add_scalar("train/lr", 3e-4 * min(1.0, step / 7), step)
        if step % 5 == 0:
            writer.add_scalar("valid/loss", 9.0 / step + 0.1, step)
            writer.add_scalar("valid/loss-vs-tokens", 9.0 / step + 0.1, tokens)
    writer.add_histogram("scales/head_scale/layer_00", torch.linspace(0.5, 1.5, 8), 20)
    writer.close()


def test_the_compact_form_gives_the_events_curves_exactly(tmp_path):
    run = tmp_path / "run"
    _write_events(run)
    from_events = read_events(run / "tensorboard")
    curve = valid_curve(str(run / "tensorboard"))
    assert [step for step, _, _ in curve] == [5, 10, 15, 20]

    path = write_compact(run)
    assert path == run / COMPACT_FILE
    record = json.loads(gzip.decompress(path.read_bytes()))
    assert record["histograms_not_kept"] == ["scales/head_scale/layer_00"]
    assert record["tags"]["train/loss"]["dtype"] == "float32"
    first = path.read_bytes()
    assert write_compact(run).read_bytes() == first  # the same events, the same bytes
    shutil.rmtree(run / "tensorboard")  # as a committed run: the compact file only

    assert read_compact(path) == from_events  # every tag, step and value, bit for bit
    assert read_scalars(run) == from_events
    assert valid_curve(str(run / "tensorboard")) == curve
    # plot reads it too (the loss figure; the scales figure needs the histogram's events)
    assert plot_main([str(run), "--output-dir", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_with_neither_form_names_the_path_and_the_fix(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScalarsNotFoundError) as info:
        read_scalars(tmp_path / "empty")
    text = str(info.value)
    assert str(tmp_path / "empty") in text and COMPACT_FILE in text
    assert "python -m megaformer.experiments.scalars export" in text
    # a ValueError too, so compare (which reports ValueErrors) says it without a traceback
    with pytest.raises(ValueError, match="no tensorboard/ events"):
        valid_curve(str(tmp_path / "empty" / "tensorboard"))
    assert plot_main([str(tmp_path / "empty")]) == 2
    assert "no tensorboard/ events" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "empty")]) == 2
    assert "no TensorBoard events" in capsys.readouterr().err


def test_a_damaged_or_foreign_compact_file_is_a_clear_error(tmp_path):
    path = tmp_path / COMPACT_FILE
    path.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a gzip-compressed JSON scalars file"):
        read_compact(path)
    path.write_bytes(gzip.compress(json.dumps({"format": "other/9", "tags": {}}).encode()))
    with pytest.raises(ValueError, match="expected 'megaformer-scalars/1'"):
        read_compact(path)


def test_export_removes_the_events_only_when_asked(tmp_path, capsys):
    run = tmp_path / "run"
    _write_events(run)
    assert main(["export", str(run)]) == 0
    assert any((run / "tensorboard").iterdir())
    assert main(["export", str(run), "--remove-events"]) == 0
    assert not (run / "tensorboard").exists() and (run / COMPACT_FILE).is_file()
    out = capsys.readouterr()
    assert COMPACT_FILE in out.out and "1 histogram tag(s) not kept" in out.err
