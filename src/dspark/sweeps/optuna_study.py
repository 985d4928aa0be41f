"""Optuna study set-up, shared by every worker of a search (no training here, so it is testable on its own).

- Storage (`optuna.storage`): "" → `sqlite:///<paths.root>/optuna.db`; a URL (`sqlite:///…`, `postgresql://…`)
  → `RDBStorage`; anything else is a file path → `JournalStorage(JournalFileBackend(path))`, the storage Optuna
  recommends for several processes on one machine. Opening it is checked: an unreachable or unusable storage is a
  `ConfigError` before any training starts.
- One study per search, named `<sweep>-<hash of the fixed config>` unless `optuna.study` names it; created with
  `load_if_exists`, a TPE sampler seeded from `seed` and the number of trials already in the study (so concurrent
  workers draw different suggestions while a single worker is reproducible), and a median pruner.
- The paper's defaults are enqueued once (`skip_if_exists`), under a file lock so that racing workers cannot enqueue
  them twice.
- `claim_trial` hands out trials until the study holds `n_trials` of them (waiting, running, complete or pruned;
  failed trials do not count, so a rerun retries them), again under the lock, so two workers never overshoot.
  A storage reached over the network (PostgreSQL) from several machines has no shared lock: there the count is
  best-effort and a trial claimed past `n_trials` is told FAIL (tagged) without running.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dspark.config import ConfigError
from dspark.config.secrets import mask_text, mask_url, remember

COUNTED_STATES = ("WAITING", "RUNNING", "COMPLETE", "PRUNED")


def default_storage(root: str | Path) -> str:
    return f"sqlite:///{Path(root).resolve() / 'optuna.db'}"


def is_url(storage: str) -> bool:
    return "://" in storage


def lock_path(storage: str, *, root: str | Path, study: str) -> Path:
    """A file lock beside a local storage file, else under paths.root (one machine)."""
    if storage.startswith("sqlite:///"):
        return Path(storage[len("sqlite:///") :] + ".lock")
    if not is_url(storage):
        return Path(storage).expanduser().resolve().with_suffix(".lock")
    digest = hashlib.sha256(f"{mask_url(storage)}|{study}".encode()).hexdigest()[:12]
    return Path(root) / f"optuna-{digest}.lock"


def open_storage(storage: str) -> Any:
    """Open (creating if needed) the storage; any failure is a ConfigError naming optuna.storage (credentials
    masked: the storage's own are remembered first, whatever shape the driver's message gives them)."""
    import optuna

    remember([storage])
    try:
        if not is_url(storage):
            from optuna.storages.journal import JournalFileBackend

            path = Path(storage).expanduser().resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        kwargs = {}
        if storage.startswith("sqlite:///"):
            Path(storage[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        elif storage.startswith(("postgresql", "mysql")):  # a dead host fails in seconds, not minutes
            kwargs["engine_kwargs"] = {"connect_args": {"connect_timeout": 10}}
        return optuna.storages.RDBStorage(url=storage, **kwargs)
    except Exception as err:  # driver missing, host unreachable, bad path: all mean "fix optuna.storage"
        raise ConfigError(
            f"optuna.storage={mask_url(storage)} cannot be opened ({type(err).__name__}: {mask_text(str(err))}). Use a "
            "sqlite:/// URL, a journal file path, or a reachable postgresql:// URL (with its driver "
            "installed); leave it empty for sqlite under paths.root."
        ) from err


def make_sampler(*, seed: int, offset: int, startup_trials: int) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=seed + offset, n_startup_trials=max(1, startup_trials))


def make_pruner(enabled: bool) -> Any:
    import optuna

    if not enabled:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)


@dataclass
class StudyHandle:
    """A loaded study plus what workers need to share it safely."""

    study: Any
    storage: str  # as configured (may hold credentials: show `mask_url(storage)`)
    lock_file: Path
    seed: int
    startup_trials: int

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialise check-then-act steps between processes of this machine."""
        from filelock import FileLock

        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.lock_file)):
            yield

    def counted(self) -> int:
        from optuna.trial import TrialState

        states = tuple(TrialState[s] for s in COUNTED_STATES)
        return len(self.study.get_trials(deepcopy=False, states=states))

    def waiting(self) -> bool:
        from optuna.trial import TrialState

        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def setup_study(
    *,
    storage: str,
    name: str,
    direction: str,
    seed: int,
    startup_trials: int,
    prune: bool,
    defaults: dict[str, Any],
    root: str | Path,
) -> StudyHandle:
    """Open the storage, create or load the study, enqueue the defaults once; call before workers start."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    handle = StudyHandle(
        study=None,
        storage=storage,
        lock_file=lock_path(storage, root=root, study=name),
        seed=seed,
        startup_trials=startup_trials,
    )
    # a database server is opened first: one that cannot be reached leaves no lock file behind
    opened = open_storage(storage) if is_url(storage) and not storage.startswith("sqlite") else None
    try:
        handle.lock_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"optuna.storage={mask_url(storage)}: cannot create {handle.lock_file.parent} ({mask_text(str(err))}); "
            "point it at a writable location."
        ) from err
    with handle.locked():  # fresh sqlite files break when two processes run the migrations at once
        opened = open_storage(storage) if opened is None else opened
        handle.study = optuna.create_study(
            storage=opened,
            study_name=name,
            direction=direction,
            load_if_exists=True,
            pruner=make_pruner(prune),
            sampler=make_sampler(seed=seed, offset=0, startup_trials=startup_trials),
        )
        if defaults:
            handle.study.enqueue_trial(dict(defaults), user_attrs={"paper_defaults": True}, skip_if_exists=True)
    return handle


def claim_trial(handle: StudyHandle, *, n_trials: int) -> Any | None:
    """The next trial to run (an enqueued one first), or None once the study holds `n_trials` counted trials."""
    with handle.locked():
        if not handle.waiting() and handle.counted() >= n_trials:
            return None
        offset = len(handle.study.get_trials(deepcopy=False))
        handle.study.sampler = make_sampler(seed=handle.seed, offset=offset, startup_trials=handle.startup_trials)
        trial = handle.study.ask()
    if is_url(handle.storage) and not handle.storage.startswith("sqlite") and handle.counted() > n_trials:
        # another machine claimed the last slot between our count and our ask: give it back without running
        from optuna.trial import TrialState

        trial.set_user_attr("overflow", True)
        handle.study.tell(trial, state=TrialState.FAIL)
        return None
    return trial


def trial_is_default(trial: Any) -> bool:
    return bool(trial.user_attrs.get("paper_defaults"))
