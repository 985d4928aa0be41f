"""The tracking store fails fast: preflight opens it once, before any work, and any failure becomes one error that
names the key to change (`tracking.uri`, or `paths.root` for the default store under it), the cause and the fix.

What the probe checks, in order: the experiment name; the URI's scheme; a server's /health; a sqlite file by itself
(not a file, read-only, not a database, cut short: MLflow would retry opening it for about 100 s) or a database
server by one connection with a short timeout; then it opens the store with MLflow and reads the experiment, with
MLflow's HTTP retries off and a short timeout (`PROBE_ENV`) so that a server which answers /health but fails its API
says so in seconds. A server is written once too (the experiment, or its `PROBE_TAG`): a read-only account fails
here. A sqlite store is only read, and a store that does not exist yet is not created: a run refused later by another
check leaves nothing under paths.root.

A run itself keeps MLflow's retries (7, about four minutes with backoff): once the store has answered, a server
restarting in the middle of hours of training is waited for rather than failing the run.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from dspark.config import ConfigError, RunConfig
from dspark.config.secrets import mask_text, mask_url, remember
from dspark.tracking.store import check_reachable, experiment_id, tracking_uri_for

#: MLflow's HTTP client while the probe runs (read per request by `mlflow.utils.rest_utils.http_request`)
PROBE_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
PROBE_TAG = "dspark.store_check"  # the experiment tag the probe writes on a server
CONNECT_TIMEOUT = 10  # seconds for one connection to a database server, or for another process's sqlite write lock
SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql")  # `postgresql+psycopg2` etc. too
#: the sweep ledgers keep `<paths.root>/ledgers/<experiment>/`: one file name (MLflow itself takes 500 characters)
MAX_EXPERIMENT_NAME = 255
SQLITE_MAGIC = b"SQLite format 3\x00"
_probed: set[tuple[str, str]] = set()

#: (what the cause says, the fix) for a store that failed to open; the first match wins
_FIXES = (
    (("read-only", "readonly", "permission denied"), "make the database file and its directory writable"),
    (
        ("not a database", "malformed", "cut short", "not a file", "encrypted"),
        "it is damaged: move it aside (`mv FILE FILE.broken`) so that a new store starts there, or restore it",
    ),
    (("no such directory",), "create the directory first"),
    (("database is locked",), "another process holds the database locked: wait for it or stop it"),
    (("revision", "out-of-date", "schema"), "it was written by another MLflow version: `mlflow db upgrade URI`"),
    (
        ("refused", "timeout", "timed out", "could not translate", "connect"),
        "check that the database server is reachable and the credentials are right",
    ),
    (
        ("module", "plugin", "driver"),
        "install the database's driver (`pip install psycopg2-binary`, `pymysql`, ...)",
    ),
)


def check_store(cfg: RunConfig) -> None:
    """Probe the store of `cfg` (module docstring); a ConfigError names the key, the cause and the fix. Each store
    and experiment is probed once per process (a sweep's cells share the sweep's)."""
    uri = tracking_uri_for(cfg)
    remember([uri])
    if (uri, cfg.tracking.experiment) in _probed:
        return
    check_experiment_name(cfg.tracking.experiment)
    check_scheme(uri)
    check_reachable(uri)
    try:
        if _open_and_read(uri, cfg):
            _probed.add((uri, cfg.tracking.experiment))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 — whatever the store raised, the fix is the store's
        raise ConfigError(store_error(cfg, uri, err)) from None


def _open_and_read(uri: str, cfg: RunConfig) -> bool:
    """Open the store and read (on a server, also write) the experiment; False when a sqlite store does not exist
    yet (the run creates it)."""
    scheme = uri.partition(":")[0].partition("+")[0].lower()
    if scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///").split("?")[0])
        if not cfg.tracking.uri and not path.parent.exists():
            return False  # the default store: paths.root is made by the run (preflight checked it can be)
        check_sqlite_file(path)
        if not path.exists():
            return False
    elif scheme not in ("http", "https"):
        check_database(uri)
    from mlflow.tracking import MlflowClient

    with _fail_fast():
        client = MlflowClient(tracking_uri=uri)
        if scheme in ("http", "https"):
            client.set_experiment_tag(experiment_id(client, cfg, artifacts=None), PROBE_TAG, "ok")
        else:
            experiment_id(client, cfg, artifacts=None, create=False)
    return True


def check_experiment_name(name: str) -> None:
    """A ConfigError unless `tracking.experiment` is a non-blank, printable name of at most MAX_EXPERIMENT_NAME."""
    problem = None
    if not name.strip():
        problem = "is empty"
    elif len(name) > MAX_EXPERIMENT_NAME:
        problem = f"is {len(name)} characters long (at most {MAX_EXPERIMENT_NAME})"
    elif not name.isprintable():
        problem = "holds a control character"
    if problem:
        shown = mask_text(name[:60]) + ("…" if len(name) > 60 else "")
        raise ConfigError(
            f"tracking.experiment={shown!r} {problem}: give the MLflow experiment a short printable name, or drop "
            "the key for the default (dspark-lab)."
        )


def check_scheme(uri: str) -> None:
    """A ConfigError unless `uri` names a store this project runs on (`SCHEMES`)."""
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*):", uri)
    if scheme is None or scheme.group(1).partition("+")[0].lower() not in SCHEMES:
        raise ConfigError(
            f"tracking.uri={mask_url(uri)} is not a tracking store: give http://HOST:PORT of a running mlflow "
            "server, sqlite:////ABSOLUTE/PATH.db, or a postgresql:// / mysql:// / mssql:// database URL; or drop "
            "tracking.uri to use the store under paths.root."
        )


def check_sqlite_file(path: Path) -> None:
    """Raise PermissionError / sqlite3.DatabaseError / FileNotFoundError when the sqlite database at `path` cannot be
    read and written; a database that does not exist yet needs a writable directory."""
    if not path.exists():
        if not path.parent.is_dir():
            raise FileNotFoundError(f"no such directory: {path.parent}")
        _check_writable(path.parent)
        return
    if not path.is_file():
        raise sqlite3.DatabaseError(f"{path} is not a file")
    for place in (path, path.parent):  # sqlite writes its journal beside the database
        _check_writable(place)
    _check_sqlite_header(path)
    with contextlib.closing(
        sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, timeout=CONNECT_TIMEOUT)
    ) as db:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads the schema pages


def _check_writable(path: Path) -> None:
    # a file without any write bit is read-only by intent, even for root (whom os.access never refuses)
    if not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222:
        raise PermissionError(f"{path} is read-only (its mode or its file system)")


def _check_sqlite_header(path: Path) -> None:
    """Refuse a file that is not sqlite, or is shorter than its header says (a copy cut short)."""
    size = path.stat().st_size
    if size == 0:
        return  # an empty file is an empty database
    with open(path, "rb") as handle:
        header = handle.read(100)
    if not header.startswith(SQLITE_MAGIC) or len(header) < 100:
        raise sqlite3.DatabaseError(f"{path} is not a database (no sqlite header)")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages, counter, valid_for = (int.from_bytes(header[i : i + 4], "big") for i in (28, 24, 92))
    if counter == valid_for and pages * page_size > size:  # the header's page count is current
        raise sqlite3.DatabaseError(f"{path} is cut short ({size:,} of {pages * page_size:,} bytes)")


def check_database(uri: str) -> None:
    """One connection to a database server with a short timeout (MLflow would retry for about 100 s)."""
    import sqlalchemy

    timeout = {} if uri.lower().startswith("mssql") else {"connect_timeout": CONNECT_TIMEOUT}
    engine = sqlalchemy.create_engine(uri, connect_args=timeout, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()


def store_error(cfg: RunConfig, uri: str, err: BaseException) -> str:
    """The message for a store that failed to open: the key, the store, the cause (masked) and the fix."""
    cause = mask_text(f"{type(err).__name__}: {err}".splitlines()[0])[:400]
    if cfg.tracking.uri:
        key, other = f"tracking.uri={mask_url(uri)}", "point tracking.uri at another store, or drop it"
    else:
        key, other = f"paths.root={cfg.paths.root} (its store {mask_url(uri)})", "set paths.root to a new directory"
    if uri.startswith(("http://", "https://")):
        fix = "the server answers /health but its API failed: check the server's log (its backend store and "
        fix += "artifact root) and the credentials"
    else:
        lowered = cause.lower()
        fix = next((f for needles, f in _FIXES if any(n in lowered for n in needles)), "check the store")
    return f"the tracking store of {key} cannot be used ({cause}); {fix}, or {other}."


@contextlib.contextmanager
def _fail_fast() -> Iterator[None]:
    """MLflow's HTTP client without retries and with a short timeout inside the block (`PROBE_ENV`)."""
    saved = {key: os.environ.get(key) for key in PROBE_ENV}
    os.environ.update(PROBE_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
