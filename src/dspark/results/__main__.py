"""`python -m dspark.results [--repo DIR] [--keep-reports] [--publish SWEEP [--ledger FILE]]`: regenerate results/
(what `make results` runs); `--publish` first copies the sweep's newest ledger from `<paths.root>/ledgers/` into
results/<sweep>/ledger.json (`dspark.results.publish`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dspark.files import ForeignOutputError
from dspark.results.build import build
from dspark.results.regenerate import find_regenerate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.results", description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path("."), help="the repository root (default: .)")
    parser.add_argument(
        "--keep-reports",
        action="store_true",
        help="do not regenerate the sweep reports from their ledgers; only the index",
    )
    parser.add_argument("--publish", metavar="SWEEP", help="publish this sweep's ledger from --root first")
    parser.add_argument("--ledger", help="with --publish: the ledger file (default: the sweep's newest)")
    parser.add_argument("--root", type=Path, default=Path("outputs"), help="the runs' paths.root (default: outputs)")
    parser.add_argument("--experiment", default="dspark-lab", help="the runs' tracking.experiment")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (args.repo / "sweeps").is_dir():
        parser.error(f"{args.repo} has no sweeps/ directory: pass --repo at the repository root")
    if args.publish:
        from dspark.results.publish import PublishError, find_ledger, publish

        try:
            ledger = find_ledger(args.root, args.publish, experiment=args.experiment, name=args.ledger)
            print(f"published {ledger} as {publish(ledger, results_dir=args.repo / 'results')}")
        except (PublishError, OSError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    regenerate = None if args.keep_reports else find_regenerate()
    try:
        written = build(args.repo, regenerate=regenerate)
    except ForeignOutputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
