"""Publishing a run's ledger into results/ (`dspark.results.publish`): the newest ledger of the sweep is copied in; a
committed ledger of another identity is archived with a line, never overwritten; nothing to publish is an error
that names the folder and the command."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dspark.results.publish import PublishError, find_ledger, publish


def _ledger(path: Path, digest: str, *, version: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "format": "dspark-sweep-ledger",
                "version": version,
                "sweep": "depth",
                "sweep_hash": digest,
                "identity": {"budget": digest},
                "cells": [],
            }
        )
    )
    return path


def test_the_newest_ledger_is_published_and_another_identity_is_archived(tmp_path):
    runs = tmp_path / "outputs" / "ledgers" / "dspark-lab"
    old = _ledger(runs / "depth-aaa.json", "aaa")
    new = _ledger(runs / "depth-bbb.json", "bbb")
    os.utime(old, (1, 1))
    assert find_ledger(tmp_path / "outputs", "depth") == new
    results = tmp_path / "results"
    publish(old, results_dir=results)
    target = publish(new, results_dir=results)
    assert json.loads(target.read_text())["sweep_hash"] == "bbb"
    archived = results / "depth" / "archive" / "ledger-aaa.json"
    assert json.loads(archived.read_text())["sweep_hash"] == "aaa"
    assert "superseded by identity bbb" in (results / "depth" / "archive" / "README.md").read_text()


def test_nothing_to_publish_names_the_folder_and_the_command(tmp_path):
    with pytest.raises(PublishError, match="python experiments/run.py sweep=depth"):
        find_ledger(tmp_path, "depth")
    with pytest.raises(PublishError, match="dspark.sweeps.migrate"):
        publish(_ledger(tmp_path / "v1.json", "ccc", version=1), results_dir=tmp_path / "results")
    assert not (tmp_path / "results").exists()
