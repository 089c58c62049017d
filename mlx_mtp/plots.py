"""Plots are optional (the ``plots`` extra): matplotlib is imported only to draw one.

``bench`` and ``train`` write their JSON/CSV/JSONL either way; without matplotlib they
say how to get the PNG files instead of failing.
"""

from __future__ import annotations

HOW_TO_INSTALL = "pip install 'mlx-mtp[plots]'"


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def missing_note(what: str) -> str:
    return f"{what} skipped: matplotlib is not installed ({HOW_TO_INSTALL} adds it)"
