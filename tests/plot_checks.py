"""What the benchmark plot tests share: a marker for the tests that draw (matplotlib is the
``bench`` extra, in ``dev``), a way to make matplotlib unimportable, and a PNG check."""

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.common import png_text

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib (the bench extra) is not installed")


def hide_matplotlib(monkeypatch) -> None:
    """Every later ``import matplotlib...`` raises ImportError, as on a machine without it
    (the GPU machine of bench/gpu_check.sh); monkeypatch puts the modules back."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def assert_png(path: Path, size: tuple[int, int] | None = None) -> dict[str, str]:
    """``path`` is a whole PNG file (its chunks by png_text, its pixels by Pillow), of
    ``size`` pixels when given; returns its text chunks."""
    from PIL import Image  # matplotlib's own dependency

    text = png_text(path)
    with Image.open(path) as image:
        assert image.format == "PNG"
        if size is not None:
            assert image.size == size
        image.load()  # decodes every pixel: a damaged image data stream raises here
    return text
