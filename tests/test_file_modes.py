"""Outputs written through a temp file and a rename get the mode a plain write would: 0666 / 0777 less the umask."""

import json
import os
import stat
from contextlib import contextmanager

import matplotlib.pyplot as plt
import pytest

from skipsearch.io.files import follow_umask, json_matches, write_atomic
from skipsearch.report.bench import BenchRow, write_outputs
from skipsearch.report.plots import save_figure


@contextmanager
def umask(mask):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_json_and_png_follow_the_umask(tmp_path, mask, expected):
    with umask(mask):
        write_atomic(tmp_path / "best.json", "{}\n")
        fig, ax = plt.subplots()
        ax.plot([0, 1])
        save_figure(fig, tmp_path / "plot.png")
        json_path, png_path = write_outputs(
            [BenchRow(method="hf greedy", tokens_per_second=1.0, speedup=1.0, identical=True)],
            tmp_path / "bench", {"model": "m"})
    assert json.loads(json_path.read_text())["rows"][0]["method"] == "hf greedy"
    for path in (tmp_path / "best.json", tmp_path / "plot.png", json_path, png_path):
        assert mode(path) == expected, path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench", "best.json", "plot.png"]  # no temp file left


def test_follow_umask_gives_folders_their_search_bit(tmp_path):
    import tempfile

    folder = tempfile.mkdtemp(dir=tmp_path)
    with umask(0o022):
        follow_umask(folder)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755


@pytest.mark.parametrize("value, hint, expected", [
    (1, float, True), (1.5, float, True), (True, float, False), (True, int, False), (True, bool, True),
    (2.0, int, False), ("x", str | None, True), (None, str | None, True), (None, str, False),
    (["a", "b"], str | list[str] | None, True), (["a", 1], list[str], False), ({"a": None}, dict[str, str | None], True),
    ({"a": 3}, dict[str, str | None], False), ([], list, True), ({}, list, False),
])
def test_json_matches_reads_a_json_value_against_a_type(value, hint, expected):
    """JSON has one number type, so an integer is a float; but a bool is neither (Python's bool is an int)."""
    assert json_matches(value, hint) is expected
