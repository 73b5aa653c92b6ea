"""The selfcheck's results file is measured: a broken restore shows up in it."""

from __future__ import annotations

import json

import numpy as np

from fastckpt.train import checkpoint
from fastckpt.train.reference import selfcheck


def test_selfcheck_writes_the_seed_fields(tmp_path):
    assert selfcheck.main([str(tmp_path)]) == 0
    results = json.loads((tmp_path / "roundtrip_results.json").read_text())
    assert results["byte_equivalent_state_machines"] == list(selfcheck.MACHINES)
    assert results["all_byte_equal"] and results["continuation_test_passed"]
    assert results["weight_tying_preserved"] and results["atomic_write_resilient"]
    assert results["manifest_schema_version"] == "2.0"
    assert abs(results["weights_file_size_bytes"] - results["expected_size_bytes_no_tying"]) < 4096
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest == checkpoint.read_manifest(tmp_path / "checkpoint")


def test_selfcheck_reports_a_reseeded_rng(tmp_path, monkeypatch):
    real = checkpoint.plan_restore

    def reseeding(slots, strict):
        steps, report = real(slots, strict)
        rng = next(obj for name, obj, _ in slots if name == "train_rng")
        for step in steps:
            if step.path == "train_rng":  # the classic bug: rebuild from the seed instead of restoring the state
                step.apply = lambda: setattr(rng.bit_generator, "state", np.random.default_rng(42).bit_generator.state)
        return steps, report

    monkeypatch.setattr(checkpoint, "plan_restore", reseeding)
    assert selfcheck.main([str(tmp_path)]) == 1
    results = json.loads((tmp_path / "roundtrip_results.json").read_text())
    assert "train_rng" not in results["byte_equivalent_state_machines"]
    assert results["all_byte_equal"] is False and results["continuation_test_passed"] is False
    assert "train_rng" in results["differences"]
