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


def save(figure, directory: str, name: str) -> None:
    """A PNG in `directory` (local or a bucket)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    pyplot().close(figure)
    (epath.Path(directory) / name).write_bytes(buffer.getvalue())
