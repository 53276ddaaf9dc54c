"""``bench.common.save_plot``, the one plotting path of every benchmark, and
``bench.common.png_text``, which reads a plot's text chunks back."""

import struct
import zlib

import pytest

from bench import common
from tests.plot_checks import assert_png, hide_matplotlib, needs_matplotlib


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def tiny_png(text: dict[str, str]) -> bytes:
    """A 1x1 grey PNG made by hand, with ``text`` as tEXt chunks."""
    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return (common.PNG_SIGNATURE + chunk(b"IHDR", header)
            + b"".join(chunk(b"tEXt", f"{k}\0{v}".encode("latin-1")) for k, v in text.items())
            + chunk(b"IDAT", zlib.compress(b"\0\x80")) + chunk(b"IEND", b""))


@needs_matplotlib
def test_save_plot_writes_a_png_of_the_figure_size_with_its_metadata(tmp_path):
    drawn = []

    def draw(figure):
        axis = figure.subplots()
        axis.plot([1, 2, 4], [3.0, 1.0, 2.0], marker="o", label="triton")
        axis.legend()
        drawn.append(figure)

    path = tmp_path / "plot.png"
    outcome = common.save_plot(draw, path, size=(4.0, 3.0), dpi=50,
                               metadata={"bench digest": "abc123"})
    assert outcome == path and len(drawn) == 1
    text = assert_png(path, size=(200, 150))
    assert text["bench digest"] == "abc123"
    assert text["Software"].startswith("Matplotlib")
    assert common.plot_entry(outcome) == "plot.png"


def test_save_plot_without_matplotlib_returns_the_reason_and_never_draws(tmp_path,
                                                                         monkeypatch):
    hide_matplotlib(monkeypatch)
    drawn = []
    path = tmp_path / "plot.png"
    outcome = common.save_plot(drawn.append, path)
    assert outcome == common.NO_MATPLOTLIB == "matplotlib is not installed: no plot"
    assert drawn == [] and not path.exists()
    assert common.plot_entry(outcome) == common.NO_MATPLOTLIB


@needs_matplotlib
def test_a_failing_drawing_is_reported_and_leaves_no_file(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(tiny_png({}))  # a plot of an earlier run

    def draw(figure):
        figure.subplots().plot([1, 2], [1, 2])
        raise ValueError("no cases to plot")

    assert common.save_plot(draw, path) == "plot failed: ValueError: no cases to plot"
    assert not path.exists()


def test_png_text_reads_the_text_chunks_of_a_whole_png(tmp_path):
    path = tmp_path / "tiny.png"
    path.write_bytes(tiny_png({"Software": "by hand", "digest": "0f" * 32}))
    assert common.png_text(path) == {"Software": "by hand", "digest": "0f" * 32}


@pytest.mark.parametrize("damage", ["signature", "crc", "truncated", "no IEND", "trailing"])
def test_png_text_refuses_a_damaged_png(tmp_path, damage):
    data = bytearray(tiny_png({"digest": "abc"}))
    if damage == "signature":
        data[1:4] = b"JPG"
    elif damage == "crc":
        data[data.index(b"abc")] ^= 0x01  # the text changes, its CRC does not
    elif damage == "truncated":
        data = data[:-6]
    elif damage == "no IEND":
        data = data[:-12]
    else:
        data += b"junk"
    path = tmp_path / "damaged.png"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        common.png_text(path)

