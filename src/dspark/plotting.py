"""Figure output shared by evaluation and report plots (matplotlib only, so reports stay free of torch imports)."""
from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Render `fig` with the Agg canvas (no global backend change) and write it as a PNG, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path
