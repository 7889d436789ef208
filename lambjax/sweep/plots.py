"""Plots of sweep and study reports: matplotlib without a display, PNGs written through the
path layer (local or a bucket)."""

import io

from etils import epath


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(figure, axis, directory: str, name: str, *, xlabel, ylabel, title, minor_grid=False):
    """A report plot's common end: its axis labels and title, a small legend, a light grid
    (on the minor ticks too where asked: log axes), the layout tightened; saved as `name`."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize="small")
    axis.grid(True, which="both" if minor_grid else "major", alpha=0.3)
    figure.tight_layout()
    save(figure, directory, name)


def save(figure, directory: str, name: str) -> None:
    """A PNG in `directory` (local or a bucket)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    pyplot().close(figure)
    (epath.Path(directory) / name).write_bytes(buffer.getvalue())
