"""``python -m megaformer.tools.evaluate --heldout RUN``: exactly the held-out documents a run was
validated on, found from its run directory (issue 39). Reads the session's 12-step lifecycle run;
launches nothing of its own."""

from __future__ import annotations

import json

import pytest

from megaformer.tools.evaluate import main

pytestmark = pytest.mark.slow  # needs the launcher-trained lifecycle run


def test_heldout_of_a_run_is_what_it_validated_on(lifecycle_reference, tmp_path, capsys):
    summary = json.loads((lifecycle_reference / "summary.json").read_text())
    config = json.loads((lifecycle_reference / "config.json").read_text())
    first = config["train"]["eval_batches"] * config["train"]["global_batch_size"]
    out = tmp_path / "first.json"
    # the run directory alone: its latest checkpoint, its data, its split seed
    assert main(["--heldout", str(lifecycle_reference), "--max-samples", str(first), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    split_seed = (
        config["data"]["split_seed"] if config["data"]["split_seed"] != -1 else config["train"]["seed"]
    )
    assert row["samples"] == first and row["split_seed"] == split_seed
    assert row["loss"] == pytest.approx(summary["final_valid_loss"], abs=2e-5)  # its last validation
    whole = tmp_path / "whole.json"
    assert main(["--heldout", str(lifecycle_reference), "--json", str(whole)]) == 0
    (all_rows,) = json.loads(whole.read_text())["results"]
    assert (
        all_rows["samples"] > first and all_rows["tokens"] == all_rows["samples"] * config["model"]["seq_len"]
    )
    printed = capsys.readouterr()
    assert "held-out" not in printed.err
    # the result line names the run whose split it is, not the data prefix alone (issue 39)
    assert f"held-out split of {lifecycle_reference} (" in printed.out
    # not a run directory: said, exit 2
    assert main(["--heldout", str(tmp_path)]) == 2
    assert "config.json: no such file; --heldout takes a run directory" in capsys.readouterr().err
