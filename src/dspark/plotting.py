"""Figure output shared by evaluation and report plots (matplotlib only, so reports stay free of torch imports)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dspark.files import atomic_output


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Render `fig` with the Agg canvas (no global backend change) and write it as a PNG, creating the folder
    (all-or-nothing: `dspark.files.atomic_output`)."""
    path = Path(path)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    with atomic_output(path) as handle:
        fig.savefig(handle, dpi=dpi, format="png")
    return path
