"""stage=export and model.import_from through the command line on the tiny target, MLflow on."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from dspark.cli import main

TRAIN = ["budget=smoke", "optim.epochs=1"]


def _runs(root: Path, stage: str):
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dspark-lab")
    return client, [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == stage]


def test_export_then_import_and_evaluate(shared_root, tmp_path, one_thread):
    root = Path(shared_root)
    assert main(["stage=train", *TRAIN, f"paths.root={root}"]) == 0
    run_dir = next(p.parent for p in (root / "runs").glob("*/drafter.pt") if (p.parent / "config.yaml").is_file())
    out = tmp_path / "deepspec"
    # export.run_dir alone: the run's own config.yaml names its target and layers
    assert (
        main(
            ["stage=export", "budget=smoke", f"paths.root={root}", f"export.run_dir={run_dir}", f"export.out_dir={out}"]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaDSparkModel"] and (out / "model.safetensors").is_file()
    client, runs = _runs(root, "export")
    artifacts = [a.path for a in client.list_artifacts(runs[0].info.run_id, "export/deepspec")]
    assert {"export/deepspec/config.json", "export/deepspec/model.safetensors"} <= set(artifacts)
    # the exported directory evaluates as a drafter, with no prepare/train stage
    assert (
        main(
            [
                "stage=eval",
                *TRAIN,
                f"paths.root={root}",
                f"model.import_from={out}",
                f"model.block_size={config['block_size']}",
            ]
        )
        == 0
    )
    client, evals = _runs(root, "eval")
    imported = [r for r in evals if r.data.tags.get("import.from") == str(out)]
    assert imported and "summary/tau" in imported[0].data.metrics and "data/sequences" not in imported[0].data.metrics
    assert imported[0].data.tags["import.kind"] == "dspark" and imported[0].data.tags["import.head"] == "markov"
    assert imported[0].info.run_name.startswith("imported-deepspec")


def test_bad_import_and_export_settings_exit_2(capsys, tmp_path):
    assert main(["stage=eval", "budget=smoke", f"paths.root={tmp_path}", f"model.import_from={tmp_path / 'nope'}"]) == 2
    assert "model.import_from" in capsys.readouterr().err
    assert main(["stage=export", "budget=smoke", f"paths.root={tmp_path}", f"export.run_dir={tmp_path}"]) == 2
    assert "export.run_dir" in capsys.readouterr().err
    assert main(["stage=export", "budget=smoke", f"paths.root={tmp_path}", "export.layout=vllm"]) == 2
    assert "export.layout" in capsys.readouterr().err
    assert not (tmp_path / "mlflow.db").exists()
