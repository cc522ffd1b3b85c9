"""scripts/fingerprint_runs.py --compare: equal fingerprints pass, any differing tensor or scalar
hash is named (the refactors' bitwise before/after proof rests on it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fingerprint_runs", REPO / "scripts" / "fingerprint_runs.py")
fingerprint_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fingerprint_runs)


def test_compare_passes_equal_runs_and_names_what_differs(tmp_path):
    before = json.loads((REPO / "bench/results/refactor/before-e8dab63.json").read_text())
    assert fingerprint_runs.compare(before, before) == []
    after = json.loads(json.dumps(before))
    path = sorted(after["runs"]["tp2_sp"]["tensors"])[3]
    after["runs"]["tp2_sp"]["tensors"][path] = "0" * 64
    after["runs"]["mlm_dp2"]["scalars_sha256"] = "1" * 64
    lines = fingerprint_runs.compare(before, after)
    assert f"tp2_sp: tensor {path} differs" in lines
    assert any(line.startswith("mlm_dp2: scalars_sha256 differs") for line in lines)
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "b.json").write_text(json.dumps(after))
    assert fingerprint_runs.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert fingerprint_runs.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
