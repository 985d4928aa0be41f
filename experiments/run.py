"""DSpark Lab entry point: `python experiments/run.py [sweep=NAME] [key=value ...]` (see experiments/default.yaml)."""

import sys
from pathlib import Path

# Run from a checkout even when the package is not installed (the Makefile installs it editable).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dspark.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
