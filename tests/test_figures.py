"""Tests for quantwm.evaluation.figures and quantwm.drivers.run_figures: every figure kind as valid, non-empty
PNG, PDF and SVG files."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from quantwm.cli import main
from quantwm.drivers.registry import RunRegistry
from quantwm.drivers.run_figures import run_figures
from quantwm.drivers.workbench import RunKey, Workbench
from quantwm.evaluation import figures as FG

pytestmark = pytest.mark.usefixtures("shared_rollouts")  # conftest.py: each rollout made once per process

FRAMES = 10


def assert_valid(path):
    data = path.read_bytes()
    assert len(data) > 1000, path
    if path.suffix == ".png":
        with Image.open(path) as im:
            im.verify()
            assert im.format == "PNG"
    elif path.suffix == ".pdf":
        assert data.startswith(b"%PDF-") and b"%%EOF" in data[-64:]
    else:
        assert ET.fromstring(data).tag.endswith("svg")


@pytest.fixture(scope="module")
def runs():
    return RunRegistry(Workbench())


def test_run_figures_writes_every_kind_in_every_format(runs, tmp_path):
    key = RunKey(seed=1, method="quantwm", frames=FRAMES)
    paths = run_figures(runs, key, tmp_path, list(FG.FIGURE_KINDS), list(FG.FORMATS), frame=FRAMES - 1,
                        pixel=[10, 50], methods=["qvg", "quantwm"])
    kinds = {(p.name.split("-")[0], p.suffix[1:]) for p in paths}
    assert kinds == {(k, f) for k in FG.FIGURE_KINDS for f in FG.FORMATS}
    for p in paths:
        assert_valid(p)


def test_figures_reject_unknown_kinds_and_formats_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="choose from png, pdf, svg"):
        run_figures(None, RunKey(), tmp_path, ["frames"], ["jpg"])
    with pytest.raises(ValueError, match="unknown figure kind 'video'"):
        run_figures(None, RunKey(), tmp_path, ["video"], ["png"])
    assert not list(tmp_path.iterdir())


def test_figures_cli_writes_the_chosen_kinds(tmp_path, capsys):
    assert main(["figures", "--frames", str(FRAMES), "--kinds", "frames,energy", "--formats", "svg",
                 "--out-dir", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == [f"energy-seed0-loop-quantwm-kv-2bit-{FRAMES}f-layer1.svg", f"frames-seed0-loop-quantwm-kv-2bit-{FRAMES}f.svg"]
    assert "wrote" in capsys.readouterr().out
    assert main(["figures", "--formats", "gif", "--out-dir", str(tmp_path)]) == 2
    assert "unknown figure format 'gif'" in capsys.readouterr().err
