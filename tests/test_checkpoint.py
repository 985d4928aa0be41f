"""drafter.pt is read with `torch.load(weights_only=True)`: our own files load (with calibration entries); a crafted
pickle is refused with an error naming the file and runs nothing; a truncated file is named too."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from dspark.api import load_trained_drafter
from dspark.drafters.checkpoint import DRAFTER_FILE, load_drafter, read_checkpoint, save_drafter
from dspark.drafters.factory import DrafterSpec, build_drafter
from dspark.stages.train import recorded_training_metrics


def _plant(marker: str) -> dict:
    """What a crafted checkpoint runs on an unsafe load: it leaves a marker file."""
    Path(marker).write_text("code ran")
    return {}


class Crafted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return _plant, (self.marker,)


@pytest.fixture(params=["torch.save", "pickle.dump"])
def crafted(request, tmp_path) -> tuple[Path, Path]:
    """A run directory whose drafter.pt would create `marker` when unpickled unsafely (a torch zip archive, or a
    bare pickle)."""
    marker = tmp_path / "marker"
    path = tmp_path / "run" / DRAFTER_FILE
    path.parent.mkdir()
    payload = {"spec": Crafted(marker), "state_dict": {}, "metrics": {}, "calibration": None}
    if request.param == "torch.save":
        torch.save(payload, path)
    else:
        with path.open("wb") as handle:
            pickle.dump(payload, handle)
    return path, marker


def test_the_crafted_file_would_run_code_on_an_unsafe_load(crafted):
    path, marker = crafted
    if path.read_bytes()[:2] == b"PK":  # a zip archive: what every reader did before
        torch.load(path, map_location="cpu", weights_only=False)
    else:
        with path.open("rb") as handle:
            pickle.load(handle)
    assert marker.read_text() == "code ran"


@pytest.mark.parametrize("reader", ["read_checkpoint", "load_drafter", "api", "recorded_metrics"])
def test_a_crafted_pickle_is_refused_and_runs_nothing(crafted, reader):
    path, marker = crafted
    if reader == "recorded_metrics":  # the sweep driver reads the drafter.pt of a config's run directory
        rc, path = _place_in_run_dir(path)
    with pytest.raises(ValueError, match="was refused") as err:
        if reader == "read_checkpoint":
            read_checkpoint(path)
        elif reader == "load_drafter":
            load_drafter(path, target=None)
        elif reader == "api":
            load_trained_drafter(path.parent, target=None)  # a run directory
        else:
            recorded_training_metrics(rc)
    assert str(path) in str(err.value) and "could run code" in str(err.value)
    assert "weights_only" not in str(err.value)  # torch's own advice (load it unsafely) is not passed on
    assert not marker.exists()


def _place_in_run_dir(path: Path):
    """Copy `path` to the drafter.pt of the budget=smoke config's run directory; returns the config and the copy."""
    from dspark.config import resolve_config
    from dspark.stages.context import RunPaths, StageContext

    rc = resolve_config(["budget=smoke", f"paths.root={path.parent.parent / 'root'}"])
    run_dir = StageContext(rc=rc, paths=RunPaths.from_config(rc.cfg)).run_dir
    run_dir.mkdir(parents=True)
    (run_dir / DRAFTER_FILE).write_bytes(path.read_bytes())
    return rc, run_dir / DRAFTER_FILE


def test_a_truncated_file_is_named(tmp_path):
    path = tmp_path / DRAFTER_FILE
    torch.save({"spec": {}, "state_dict": {"w": torch.zeros(64)}}, path)
    path.write_bytes(path.read_bytes()[:80])
    with pytest.raises(ValueError, match="not a readable drafter.pt") as err:
        read_checkpoint(path)
    assert str(path) in str(err.value)


def test_a_torch_file_that_is_not_a_drafter_is_named(tmp_path):
    path = tmp_path / DRAFTER_FILE
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a drafter.pt of DSpark Lab"):
        read_checkpoint(path)


def test_our_own_drafter_pt_loads_safely_with_calibration(tiny, tmp_path):
    spec = DrafterSpec(
        kind="dspark",
        head="markov",
        depth=1,
        block_size=4,
        markov_rank=8,
        feature_layers=tuple(tiny.feature_layer_ids),
        mask_token_id=tiny.mask_token_id,
        target_fingerprint=tiny.fingerprint,
    )
    drafter = build_drafter(spec, tiny)
    calibration = {
        "T=1": {
            "method": "sts",
            "temperatures": [1.0, 0.9, 1.1, 1.2],
            "grid": [0.5, 1.0, 2.0],
            "n_bins": 10,
            "num_rounds": 3,
            "metrics_before": {"ece": [0.1] * 4, "count": [3] * 4},
            "rounds": {
                "conf": torch.rand(3, 4, dtype=torch.float64),
                "accepted_prefix": torch.tensor([0, 2, 4]),
                "valid": torch.ones(3, 4, dtype=torch.bool),
            },
        }
    }
    path = tmp_path / DRAFTER_FILE
    save_drafter(
        path, spec=spec, state_dict=drafter.state_dict(), metrics={"val/tau_prob": 1.5}, calibration=calibration
    )
    loaded, loaded_spec, payload = load_drafter(path, tiny, block_size=4)
    assert loaded_spec == spec and payload["metrics"] == {"val/tau_prob": 1.5}
    assert payload["calibration"]["T=1"]["temperatures"] == [1.0, 0.9, 1.1, 1.2]
    assert torch.equal(payload["calibration"]["T=1"]["rounds"]["conf"], calibration["T=1"]["rounds"]["conf"])
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
