"""The MLflow front door: runs-table URLs in the model-training view (no credentials printed), run names that lead with
what tells runs apart, one name per logged param, reports that render with their figures in the artifact view, and
the headline that a run prints last."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest

from dspark.tracking.artifacts import inline_html, log_report, markdown_to_html
from dspark.tracking.ui import (
    LOCAL_UI,
    SHARED_VIEW_TAG,
    run_url,
    runs_table_url,
    ui_base,
    ui_column,
    ui_command,
    ui_lines,
)


class FakeClient:
    """Records experiment tags and logged artifacts (name → bytes) like an MlflowClient would."""

    def __init__(self, *, refuse_tags: bool = False) -> None:
        self.tags: dict[str, str] = {}
        self.artifacts: dict[str, bytes] = {}
        self.refuse_tags = refuse_tags

    def get_experiment(self, experiment_id):
        return SimpleNamespace(tags=dict(self.tags))

    def set_experiment_tag(self, experiment_id, key, value):
        if self.refuse_tags:
            raise PermissionError("no permission")
        self.tags[key] = value

    def log_artifact(self, run_id, local_path, artifact_path=None):
        self.artifacts[f"{artifact_path}/{Path(local_path).name}"] = Path(local_path).read_bytes()


def store(uri: str, **client) -> SimpleNamespace:
    return SimpleNamespace(uri=uri, experiment_id="7", client=FakeClient(**client))


def query(url: str) -> dict[str, str]:
    fragment = urlsplit(url).fragment
    return {k: v[0] for k, v in parse_qs(fragment.split("?", 1)[1]).items()}


def test_local_store_url_is_the_runs_tab_of_the_training_view_with_the_filter():
    url = runs_table_url(store("sqlite:////data/x/mlflow.db"), filter_string="tags.`sweep.name` = 'depth'")
    assert url.startswith(f"{LOCAL_UI}/#/experiments/7/runs?workflowType=machine_learning&searchFilter=")
    assert query(url) == {"workflowType": "machine_learning", "searchFilter": "tags.`sweep.name` = 'depth'"}
    assert " " not in url and "'" not in url and "`" not in url  # a terminal shows it as one clickable link
    assert runs_table_url(store("sqlite:///m.db")) == f"{LOCAL_UI}/#/experiments/7/runs?workflowType=machine_learning"


def test_server_url_is_printed_without_credentials():
    s = store("https://alice:s3cret@mlflow.example.org:8443/prefix/")
    url = runs_table_url(s, filter_string="tags.budget = 'cpu'")
    assert url.startswith("https://mlflow.example.org:8443/prefix/#/experiments/7/runs?")
    assert "alice" not in url and "s3cret" not in url
    assert ui_base("http://bob@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert ui_lines(s, url=url) == [f"MLflow runs table: {url}"]  # a server: nothing to start
    assert (
        run_url(s, "abc") == "https://mlflow.example.org:8443/prefix/#/experiments/7/runs/abc?"
        "workflowType=machine_learning"
    )


def test_local_store_prints_the_command_that_serves_it_and_masks_a_database_password():
    lines = ui_lines(store("sqlite:////data/x/mlflow.db"), url="U")
    assert lines[0] == "MLflow runs table: U"
    assert re.search(r"mlflow ui --backend-store-uri sqlite:////data/x/mlflow\.db\)$", lines[1])
    command = ui_command("postgresql://dspark:hunter2@db.local:5432/mlflow")
    assert "hunter2" not in command and "postgresql://dspark:***@db.local:5432/mlflow" in command


def test_columns_are_saved_as_a_shared_view_the_url_opens():
    s = store("sqlite:///m.db")
    columns = ["params.model.depth", "metrics.summary/tau", "tags.budget"]
    url = runs_table_url(s, filter_string="tags.`sweep.name` = 'depth'", columns=columns, view_name="sweep depth")
    params = query(url)
    assert set(params) == {"workflowType", "viewStateShareKey"}  # a search facet in the URL would void the view
    envelope = json.loads(s.client.tags[SHARED_VIEW_TAG + params["viewStateShareKey"]])
    assert envelope["name"] == "sweep depth" and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])
    assert state["searchFilter"] == "tags.`sweep.name` = 'depth'"
    assert state["selectedColumns"] == ["params.`model.depth`", "metrics.`summary/tau`", "tags.`budget`"]
    again = runs_table_url(s, filter_string="tags.`sweep.name` = 'depth'", columns=columns, view_name="sweep depth")
    assert again == url and len(s.client.tags) == 1  # the same view is saved once
    refused = store("sqlite:///m.db", refuse_tags=True)
    assert query(runs_table_url(refused, filter_string="f", columns=columns)) == {
        "workflowType": "machine_learning",
        "searchFilter": "f",
    }  # no tag: the filter alone
    with pytest.raises(ValueError, match="KIND.KEY"):
        ui_column("depth")


def test_parent_and_cell_run_names_lead_with_what_tells_them_apart():
    from dspark.tracking.runs import cell_run_name, parent_name

    assert parent_name(sweep="depth", sweep_hash="1a2b3c4d5e6f", budget="cpu-ref") == "sweep-depth cpu-ref 1a2b3c4d5e6f"
    assert parent_name(sweep="depth", sweep_hash="1a2b3c4d5e6f", budget=None) == "sweep-depth 1a2b3c4d5e6f"
    assert (
        cell_run_name("model.depth=3 seed=1", "dspark-markov-d3-g7-s1")
        == "model.depth=3 seed=1 · dspark-markov-d3-g7-s1"
    )


def test_open_parent_and_settle_attempt_name_runs_in_a_real_store(tmp_path):
    from dspark.config import resolve_config
    from dspark.tracking import open_store
    from dspark.tracking.runs import open_parent, settle_attempt

    s = open_store(resolve_config([f"paths.root={tmp_path}"]).cfg)
    parent, reused = open_parent(s, sweep="depth", sweep_hash="1a2b3c4d5e6f", tags={"budget": "cpu-ref"})
    assert not reused and s.client.get_run(parent).info.run_name == "sweep-depth cpu-ref 1a2b3c4d5e6f"
    s.client.update_run(parent, name="sweep-depth")  # a parent named before names carried budget and hash
    assert open_parent(s, sweep="depth", sweep_hash="1a2b3c4d5e6f", tags={"budget": "cpu-ref"}) == (parent, True)
    assert s.client.get_run(parent).info.run_name == "sweep-depth cpu-ref 1a2b3c4d5e6f"
    child = s.create_run(run_name="latency-markov-d3-g7-s1", tags={"sweep.attempt": "a1"}, parent_run_id=parent)
    assert settle_attempt(s, "a1", ok=True, label="model.depth=3 seed=1") == child
    assert s.client.get_run(child).info.run_name == "model.depth=3 seed=1 · latency-markov-d3-g7-s1"
    settle_attempt(s, "a1", ok=True, label="model.depth=3 seed=1")  # already leads: unchanged
    assert s.client.get_run(child).info.run_name == "model.depth=3 seed=1 · latency-markov-d3-g7-s1"


REPORT = """# Evaluation — dspark-x

**τ 1.41 [1.37, 1.45] per prompt**

- command: `python experiments/run.py budget=smoke`
- a wrapped item that goes on
  on the next line, with *emphasis* and a [link](other.md)
  - a nested item
1. first
2. second

| group | τ | note |
|---|---|---|
| gsm8k | 1.43 | a \\| b |

![cond@k](eval-x-cond.png)

<experiment> & co. stay text
"""


def test_markdown_subset_renders_to_html():
    page = markdown_to_html(REPORT, title="t", image_src=lambda src: f"data:{src}")
    assert "<h1>Evaluation — dspark-x</h1>" in page
    assert "<p><strong>τ 1.41 [1.37, 1.45] per prompt</strong></p>" in page
    assert "<li>command: <code>python experiments/run.py budget=smoke</code></li>" in page
    assert (
        "<li>a wrapped item that goes on on the next line, with <em>emphasis</em> and a "
        '<a href="other.md">link</a><ul><li>a nested item</li></ul></li>'
    ) in page
    assert "<ol><li>first</li><li>second</li></ol>" in page
    assert "<thead><tr><th>group</th><th>τ</th><th>note</th></tr></thead>" in page
    assert "<tr><td>gsm8k</td><td>1.43</td><td>a | b</td></tr>" in page
    assert '<img alt="cond@k" src="data:eval-x-cond.png">' in page
    assert "&lt;experiment&gt; &amp; co. stay text" in page and "<experiment>" not in page


def test_inline_markup_keeps_arithmetic_and_code_literal():
    assert inline_html("2 * 3 * 4 and `a*b*c` and x_1") == "2 * 3 * 4 and <code>a*b*c</code> and x_1"
    assert (
        inline_html("*Why it is small*: **all** (3 sets)") == "<em>Why it is small</em>: <strong>all</strong> (3 sets)"
    )


def test_log_report_logs_markdown_html_with_inlined_figures_and_the_figures(tmp_path):
    figure = tmp_path / "eval-x-cond.png"
    figure.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    report = tmp_path / "eval-x.md"
    report.write_text(REPORT, encoding="utf-8")
    s = store("sqlite:///m.db")
    logged = log_report(s, "run", report, [figure, tmp_path / "missing.png"], artifact_path="eval")
    assert logged == ["eval/eval-x.md", "eval/eval-x.html", "eval/eval-x-cond.png"]
    page = s.client.artifacts["eval/eval-x.html"].decode()
    assert 'src="data:image/png;base64,iVBORw0KGgpmYWtl"' in page and "![" not in page
    assert s.client.artifacts["eval/eval-x.md"] == report.read_bytes()


def test_headline_states_tau_in_its_setting_and_the_speed_policy_speed_up():
    from dspark.config.schema import DecodeConfig
    from dspark.stages.evaluate import headline

    def summary(**overall):
        base = {
            "tau": 1.43,
            "tau_prompt_mean": 1.41,
            "tau_prompt_ci95": 0.04,
            "prompts": 9.0,
            "speedup": 0.7,
            "speedup_prompt_mean": 0.69,
            "speedup_prompt_ci95": 0.05,
        }
        return SimpleNamespace(overall=base | overall)

    speed = summary(prompts=6.0, speedup_prompt_mean=1.21, speedup_prompt_ci95=0.06)
    line = headline(DecodeConfig(policy="fixed"), summary(), speed, note="", block_size=7)
    assert line == (
        "τ 1.41 [1.37, 1.45] per prompt, 1.43 pooled (fixed ℓ=γ=7, T=1, 9 prompts) · speed-up "
        "1.21× [1.15, 1.27] per prompt with decode.policy=scheduler vs target-only on this machine "
        "(6 prompts)"
    )
    no_baseline = headline(
        DecodeConfig(policy="fixed", baseline=False),
        summary(speedup_prompt_mean=math.nan),
        None,
        note="not measured (decode.baseline=false)",
        block_size=7,
    )
    assert no_baseline.endswith("· speed-up not measured (decode.baseline=false)")
    own = headline(DecodeConfig(policy="scheduler"), summary(speedup_prompt_mean=1.3), None, note="", block_size=7)
    assert (
        "(decode.policy=scheduler, T=1, 9 prompts)" in own
        and "1.30× [1.25, 1.35] per prompt with decode.policy=scheduler" in own
    )
    no_head = headline(
        DecodeConfig(policy="fixed"),
        summary(),
        None,
        block_size=7,
        note="dflash has no confidence head for decode.policy=scheduler",
    )
    assert no_head.endswith(
        "with decode.policy=fixed vs target-only on this machine; dflash has no confidence head "
        "for decode.policy=scheduler (9 prompts)"
    )


def test_speed_prompts_are_spread_over_the_sets():
    from dspark.stages.evaluate import speed_subset

    prompts = [SimpleNamespace(dataset=d, prompt_id=f"{d}{i}") for d in ("a", "b", "c") for i in range(3)]
    assert [p.prompt_id for p in speed_subset(prompts, 4)] == ["a0", "b0", "c0", "a1"]
    assert len(speed_subset(prompts, 50)) == 9


def test_portable_paths_never_write_this_machines_directories(tmp_path):
    from dspark.stages.evaluate import portable_command, portable_path

    ctx = SimpleNamespace(paths=SimpleNamespace(root=tmp_path))
    assert portable_path(tmp_path / "runs" / "x" / "drafter.pt", ctx=ctx) == "runs/x/drafter.pt"
    assert portable_path("/elsewhere/models/qwen", ctx=ctx) == "…/qwen"
    assert portable_path("tiny", ctx=ctx) == "tiny" and portable_path(None, ctx=ctx) is None
    command = portable_command(
        [
            "budget=smoke",
            f"paths.root={tmp_path}",
            f"paths.reports={tmp_path}/r",
            f"data.local_dir={tmp_path}/prompts",
            "tracking.uri=http://u:pw@host:5000",
        ],
        ctx=ctx,
    )
    assert command == (
        "python experiments/run.py budget=smoke data.local_dir=prompts tracking.uri=http://u:***@host:5000"
    )


def test_smoke_run_logs_each_param_once_and_ends_with_the_headline(tmp_path, capsys, monkeypatch):
    """A smoke run end to end: every param is a config key or one of the few values only training resolves, none
    of which repeats a config key's value under its own leaf (`model.depth` / `drafter_config/depth`); the console's
    last lines are the UI links and the headline; nothing the evaluation wrote names paths.root."""
    import torch
    from mlflow.tracking import MlflowClient

    from dspark.cli import main
    from dspark.config import resolve_config
    from dspark.stages.experiment import RUN_ID_ENV
    from dspark.tracking.store import _flat_params

    for name in (RUN_ID_ENV, "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["budget=smoke", f"paths.root={tmp_path}"]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("τ ") and "with decode.policy=scheduler vs target-only on this machine" in out[-1]
    assert out[-4].startswith("MLflow runs table: http://127.0.0.1:5000/#/experiments/")
    assert "mlflow ui --backend-store-uri sqlite:///" in out[-3] and out[-2].startswith("  this run: http://")

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("dspark-lab").experiment_id])
    params = run.data.params
    config_keys = set(_flat_params(resolve_config(argv).cfg))
    assert set(params) - config_keys == {
        "resolved/feature_layers",
        "resolved/mask_token_id",
        "resolved/target_fingerprint",
    }
    for extra in set(params) - config_keys:  # carries what the config lacks, not a copy under another name
        leaf = re.split(r"[./]", extra)[-1]
        copies = [k for k in config_keys if re.split(r"[./]", k)[-1] == leaf and params[k] == params[extra]]
        assert not copies, f"{extra} = {params[extra]} repeats {copies}"
    assert {"speed/speedup_prompt_mean", "summary/tau"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    assert any(p.endswith(".html") for p in artifacts) and any(p.endswith("-cond.png") for p in artifacts)
    written = [*tmp_path.glob("runs/*/evals/*/meta.json"), *tmp_path.glob("reports/*.md")]
    assert written and not [p for p in written if str(tmp_path) in p.read_text()]


def test_the_sqlite_lock_sits_beside_the_database_whatever_paths_root(tmp_path):
    """Two machines (their own paths.root) sharing one sqlite file must wait on one lock, or MLflow's schema
    migration races ("table _alembic_tmp_… already exists")."""
    from dspark.tracking.store import sqlite_lock_path

    shared = f"sqlite:///{tmp_path / 'server.db'}"
    assert (
        sqlite_lock_path(shared, root=tmp_path / "m0")
        == sqlite_lock_path(shared, root=tmp_path / "m1")
        == tmp_path / ".server.db.lock"
    )
    assert (
        sqlite_lock_path(f"sqlite:///{tmp_path}/root/mlflow.db", root=tmp_path / "root")
        == tmp_path / "root" / ".mlflow.db.lock"
    )  # the default store: the lock of before
    assert sqlite_lock_path("sqlite://", root=tmp_path) == tmp_path / ".mlflow.db.lock"


def test_what_a_run_records_names_no_machine_path_and_no_password(tmp_path):
    """config.yaml, the flat params and the recorded command leave out paths.* and mask a URI's password."""
    from dspark.config import resolve_config
    from dspark.tracking.store import _flat_params, portable_config_yaml
    from dspark.tracking.ui import public_command

    argv = [f"paths.root={tmp_path}", "budget=smoke", "optuna.storage=postgresql://me:hunter2@db.example/optuna"]
    cfg = resolve_config(argv).cfg
    recorded = portable_config_yaml(cfg) + repr(_flat_params(cfg)) + public_command(argv)
    assert str(tmp_path) not in recorded and "hunter2" not in recorded
    assert "postgresql://me:***@db.example/optuna" in recorded and "budget=smoke" in recorded
    assert str(tmp_path) in repr(cfg.paths) and "hunter2" in cfg.optuna.storage  # control: the config has both
