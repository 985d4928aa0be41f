"""MLflow store access (PLATFORM_NOTES "MLflow"): explicit absolute sqlite URI, explicit artifact root, runs created
with `MlflowClient` so Lightning's `MLFlowLogger(run_id=...)` attaches to them, flat tags, the resolved config as an
artifact, `summary/*` metrics for reports.
"""

from __future__ import annotations

import base64
import os
import platform
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.config import ConfigError, RunConfig
from dspark.config.secrets import mask_text, mask_tree, split_credentials
from dspark.files import atomic_write_text
from dspark.hardware import machine_summary
from dspark.tracking.ui import public_uri


def tracking_uri_for(cfg: RunConfig) -> str:
    """`tracking.uri` if set, else `sqlite:///<paths.root>/mlflow.db` (absolute)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    return f"sqlite:///{Path(cfg.paths.root).resolve() / 'mlflow.db'}"


def check_reachable(uri: str, *, timeout: float = 5.0) -> None:
    """Fail before any work when an http(s) tracking server does not answer /health. The probe sends the URI's
    credentials as HTTP basic auth (urllib refuses a `user:password@` host); messages show them masked."""
    if not uri.startswith(("http://", "https://")):
        return
    bare, user, password = split_credentials(uri)
    parts = urllib.parse.urlsplit(bare)  # /health under the server's path prefix, its query kept
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/health")))
    if user is not None:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode("ascii")
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if resp.status == 200:
                return
            status = f"answered {resp.status}"
    except urllib.error.HTTPError as err:
        status = f"answered {err.code} {err.reason}"
    except (urllib.error.URLError, OSError, ValueError) as err:  # refused, timed out, no such host, a bad port
        raise ConfigError(
            f"tracking.uri={public_uri(uri)} is unreachable ({mask_text(str(err))}). Start it with `mlflow server "
            "--host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$PWD/outputs/mlflow.db`, or drop "
            "tracking.uri to use the local sqlite store."
        ) from None
    raise ConfigError(
        f"tracking.uri={public_uri(uri)}: /health {status}, not 200. Check the URL (an MLflow server answers "
        "/health), its credentials, and the server's log."
    )


@dataclass
class TrackingStore:
    """A thin handle on one MLflow store and experiment."""

    uri: str
    experiment_id: str
    client: Any  # mlflow.tracking.MlflowClient

    def create_run(self, *, run_name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
        """Create a RUNNING run (child of `parent_run_id` if given) and return its id."""
        tags = {k: str(v) for k, v in tags.items()}
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        return run.info.run_id

    def log_config(self, run_id: str, cfg: RunConfig, *, run_dir: Path) -> None:
        """Write the resolved config next to the run's results and attach it as an artifact; flat params too.

        Both leave out `paths.*` (this machine's directories: the file sits in the run directory under paths.root)
        and mask every credential, so nothing recorded names a machine's path or a secret."""
        path = atomic_write_text(run_dir / "config.yaml", portable_config_yaml(cfg))
        self.client.log_artifact(run_id, str(path))
        params = _flat_params(cfg)
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(k, v[:250]) for k, v in params.items()])

    def log_metrics(self, run_id: str, metrics: dict[str, float], *, step: int = 0) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def finish(self, run_id: str, *, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def _portable_tree(cfg: RunConfig) -> dict[str, Any]:
    """The config as recorded: without the `paths` group, every value's credentials masked
    (`dspark.config.secrets`: any key holding a URL, not only tracking.uri and optuna.storage)."""
    from dspark.config.loader import to_dict

    return mask_tree({k: v for k, v in to_dict(cfg).items() if k != "paths"})


def portable_config_yaml(cfg: RunConfig) -> str:
    """config.yaml of a run: the resolved config less `paths.*` (see `log_config`)."""
    import yaml

    return (
        "# the resolved config of this run; paths.* are left out (they name one machine's directories)\n"
        + yaml.safe_dump(_portable_tree(cfg), sort_keys=False)
    )


def _flat_params(cfg: RunConfig) -> dict[str, str]:
    from dspark.config.loader import flatten

    return {k: str(v) for k, v in flatten(_portable_tree(cfg)).items()}


def open_store(cfg: RunConfig) -> TrackingStore:
    """Open (creating if needed) the store and experiment for this config."""
    uri = tracking_uri_for(cfg)
    check_reachable(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri  # Lightning reads it at import; keep them in agreement
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:"):
        client = MlflowClient(tracking_uri=uri)
        return TrackingStore(uri=uri, experiment_id=experiment_id(client, cfg, artifacts=None), client=client)
    Path(cfg.paths.root).mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    # Two processes opening a new sqlite store at once race in MLflow's schema migration, which the client runs
    # when it is built ("Online migration expected to match one row ... 0 found"), and in create_experiment; the
    # first opener does both while the others wait. The lock sits beside the database, so processes with their own
    # paths.root that share one `tracking.uri=sqlite:///…` file wait on the same lock.
    with FileLock(str(sqlite_lock_path(uri, root=Path(cfg.paths.root)))):
        client = MlflowClient(tracking_uri=uri)
        artifacts = (Path(cfg.paths.root).resolve() / "mlartifacts").as_uri()
        return TrackingStore(uri=uri, experiment_id=experiment_id(client, cfg, artifacts=artifacts), client=client)


def sqlite_lock_path(uri: str, *, root: Path) -> Path:
    """`<dir>/.<db>.lock` beside the database file of a `sqlite:///` URI (`<root>/.mlflow.db.lock` for the default
    store); under `root` for an in-memory database."""
    database = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else ""
    if database in ("", ":memory:"):
        return root.resolve() / ".mlflow.db.lock"
    path = Path(database).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent / f".{path.name}.lock"


def experiment_id(client: Any, cfg: RunConfig, *, artifacts: str | None, create: bool = True) -> str | None:
    """The id of experiment `tracking.experiment`, created (with `artifacts` as its artifact root) if absent and
    `create` (else None); a ConfigError when it was deleted (MLflow keeps its name but refuses new runs in it)."""
    name = cfg.tracking.experiment
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise ConfigError(
            f"tracking.experiment={name} was deleted in this store: restore it (`mlflow experiments restore "
            f"--experiment-id {exp.experiment_id}`) or choose another tracking.experiment."
        )
    if exp is not None or not create:
        return exp.experiment_id if exp is not None else None
    try:
        return client.create_experiment(name, artifact_location=artifacts)
    except Exception:
        exp = client.get_experiment_by_name(name)  # another process of a shared server created it meanwhile
        if exp is None:
            raise
        return exp.experiment_id


def git_provenance(repo: Path) -> dict[str, str]:
    """Commit, dirty flag and machine, for run tags and report headers."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "git.commit": git("rev-parse", "HEAD") or "unknown",
        "git.dirty": str(bool(git("status", "--porcelain", "--untracked-files=no"))),
        # the host name alone ("vm") does not tell an AMX Xeon from either EPYC generation
        "machine": f"{platform.node()} {platform.machine()}: {machine_summary()}",
    }
