"""`main(argv)`: the command line of DSpark Lab (`python experiments/run.py [sweep=NAME] [key=value ...]`).

It parses and dispatches: one experiment (`dspark.stages.experiment`) or a whole sweep (`dspark.sweeps.driver`).
Exit codes: 0 success, 1 the run failed (the MLflow run is marked FAILED), 2 bad configuration (nothing ran),
130 interrupted (Ctrl-C: the run is marked KILLED; the same command resumes).

No credential of the command line reaches the console: they are remembered first (`dspark.config.secrets`), and
errors, log records and a traceback are masked on their way out.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any, TextIO

from dspark.config import ConfigError, resolve_config
from dspark.config.secrets import mask_text, remember


def main(argv: list[str] | None = None) -> int:
    """Resolve the config, then run one experiment or a whole sweep; the console is masked meanwhile."""
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    remember(argv)
    sys.excepthook = _masked_excepthook
    streams = sys.stdout, sys.stderr
    # every writer of the console (our prints, MLflow's and Lightning's, a library's warning) goes through here
    sys.stdout, sys.stderr = (s if isinstance(s, MaskedStream) else MaskedStream(s) for s in streams)
    try:
        return _run(argv)
    finally:
        sys.stdout, sys.stderr = streams


def _run(argv: list[str]) -> int:
    try:
        rc = resolve_config(argv)  # no torch imported yet: a bad key or value is refused in well under a second
    except ConfigError as err:
        print(f"error: {mask_text(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before any run started; nothing to resume.", file=sys.stderr)
        return 130
    from dspark.hardware import keep_freed_memory

    keep_freed_memory()  # before any tensor: large blocks are reused instead of page-faulted in every step
    from dspark.stages.experiment import RunInterrupted, preflight, run_experiment

    try:
        try:
            preflight(rc, claim=not rc.cfg.sweep)  # a sweep claims its outputs after its own checks
        except ConfigError as err:
            print(f"error: {mask_text(str(err))}", file=sys.stderr)
            return 2
        if rc.cfg.sweep:
            from dspark.sweeps.driver import run_sweep

            return run_sweep(rc)  # it reports its own interruptions (finished cells are kept)
        return run_experiment(rc)
    except RunInterrupted as err:
        print(
            f"interrupted: the run is marked KILLED (kept: {err.kept}). Rerun the same command to resume.",
            file=sys.stderr,
        )
        return 130
    except KeyboardInterrupt:
        print("interrupted before any run started; nothing to resume.", file=sys.stderr)
        return 130


class MaskedStream:
    """A console stream whose writes have their credentials masked (`mask_text`); all else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask_text(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, flush, encoding, ...
        return getattr(self._stream, name)


class SecretFilter(logging.Filter):
    """Masks credentials in a record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = mask_text(record.getMessage()), ()
        except Exception:  # noqa: BLE001 — a malformed record: the handler reports it as logging does
            return True
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.exc_text = mask_text(record.exc_text) if record.exc_text else record.exc_text
        return True


def _masked_excepthook(kind, value, tb) -> None:
    """An uncaught exception's traceback, credentials masked."""
    sys.stderr.write(mask_text("".join(traceback.format_exception(kind, value, tb))))


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    for handler in root.handlers:  # a handler's filter sees the records of every logger that propagates to it
        if not any(isinstance(f, SecretFilter) for f in handler.filters):
            handler.addFilter(SecretFilter())
    logging.getLogger("lightning.pytorch").propagate = False  # Lightning prints its own lines
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
