"""Convert a version-1 sweep ledger (named by a hash of every default) into version 2 (named by the sweep's identity).

    python -m dspark.sweeps.migrate OLD.json [NEW.json]

The identity is read back from what the cells recorded: the sweep command on their `command` tag (its axis
selections, output paths and tracking keys left out, as `dspark.sweeps.identity` does), the budget, today's recipe
and supervision versions. Params that name a machine's paths or a tracking server are dropped. NEW.json defaults to
`<OLD stem>.v2.json` beside OLD; an existing NEW.json is never overwritten.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from dspark.config import resolve_config
from dspark.tracking import ledger as cell_ledger


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 ledger's content as version 2 (cells unchanged but for the params of `paths.*` / `tracking.*` /
    `optuna.*`, which are dropped)."""
    from dspark.sweeps.driver import plan_grid
    from dspark.sweeps.spec import load_sweep

    cells = data.get("cells") or []
    if data.get("version") != 1 or not cells:
        raise ValueError("not a version-1 sweep ledger with cells")
    argv = shlex.split(cells[0]["tags"]["command"])
    argv = (
        [
            a
            for a in argv[argv.index("experiments/run.py") + 1 :]
            if not a.startswith(("paths.", "tracking.", "optuna."))
        ]
        if "experiments/run.py" in argv
        else []
    )
    spec = load_sweep(data["sweep"])
    plan = plan_grid(resolve_config(argv), spec, check=False)
    local = ("paths.", "tracking.", "optuna.")
    entries = [
        c | {"params": {k: v for k, v in (c.get("params") or {}).items() if not k.startswith(local)}} for c in cells
    ]
    return {
        "format": cell_ledger.LEDGER_FORMAT,
        "version": cell_ledger.LEDGER_VERSION,
        "sweep": data["sweep"],
        "sweep_hash": plan.sweep_hash,
        "identity": plan.identity,
        "cells": sorted(entries, key=cell_ledger._index),
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    old = Path(argv[0])
    new = Path(argv[1]) if len(argv) == 2 else old.with_name(f"{old.stem}.v2.json")
    if new.exists():
        print(f"error: {new} exists; name another output file (nothing is overwritten)", file=sys.stderr)
        return 2
    try:
        data = json.loads(old.read_text())
        payload = upgrade(data)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {old}: {err}", file=sys.stderr)
        return 2
    cell_ledger.write_ledger(
        new,
        sweep=payload["sweep"],
        sweep_hash=payload["sweep_hash"],
        identity=payload["identity"],
        entries=payload["cells"],
    )
    print(f"{new}: {len(payload['cells'])} cells, sweep {payload['sweep']} hash {payload['sweep_hash']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
