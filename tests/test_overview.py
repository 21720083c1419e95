"""The long-run overview (quantwm/drivers/overview.py) and its app handlers (app/overview_handlers.py)."""
import numpy as np
import pytest
import torch
from tiny_world import TINY, tiny_world_model

from app import overview_handlers as oh
from quantwm.drivers.long_record import record_long
from quantwm.drivers.overview import PANEL_HEIGHT, STRIP_WIDTH, THUMB, overview, overview_strip, strip_frame, table_rows
from quantwm.drivers.views import RunView
from quantwm.drivers.workbench import RunKey
from quantwm.evaluation.runfile import read_run

FRAMES = 14


class Runs:
    """The one method of a RunRegistry the handlers use."""

    def __init__(self, views: dict):
        self.views = views

    def view(self, run_id):
        if run_id not in self.views:
            raise ValueError(f"run {run_id!r} is not generated: press Generate")
        return self.views[run_id]


@pytest.fixture(scope="module")
def long_view(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("overview") / "long.safetensors"
    record_long(tiny_world_model(), RunKey(0, "loop", "quantwm", "kv", 2, FRAMES, 2.5), path, window=2,
                steps=1, sensitivity_frames=4)
    return RunView(read_run(path), "long")


def test_strip_frame_maps_columns_onto_frames_and_refuses_outside():
    assert strip_frame(0, 512) == 0 and strip_frame(STRIP_WIDTH - 1, 512) == 511
    assert strip_frame(STRIP_WIDTH / 2, 512) == 256 and strip_frame(10, 1, 20) == 0
    for x in (-1, STRIP_WIDTH):
        with pytest.raises(ValueError, match="outside the strip"):
            strip_frame(x, 512)


def test_overview_strip_puts_each_frame_under_its_columns():
    T = 100
    thumbs = np.zeros((T, 8, 8, 3), np.uint8)
    thumbs[:, :, :, 0] = np.arange(T)[:, None, None]  # frame t is red level t
    curves = {"psnr": [None] * 4 + list(np.linspace(40, 30, T - 4)), "tdiff": [None] + [0.01] * (T - 1)}
    img = overview_strip(curves, thumbs, context_frames=4, current=50)
    assert img.shape == (2 * PANEL_HEIGHT + THUMB, STRIP_WIDTH, 3) and img.dtype == np.uint8
    row = img[-THUMB // 2]
    n = STRIP_WIDTH // THUMB
    for i in (0, 7, n - 1):
        mid = (i * STRIP_WIDTH // n + (i + 1) * STRIP_WIDTH // n) // 2
        assert row[mid, 0] == strip_frame(mid, T)
    c = int(50.5 * STRIP_WIDTH / T)
    assert tuple(row[c - 1]) == (255, 215, 0)  # the player's frame marked
    assert overview_strip({}, thumbs).shape == (THUMB, STRIP_WIDTH, 3)  # no curve: the thumbnails alone


def test_overview_of_a_long_run_file_has_its_curves_table_and_sensitivity(long_view):
    ov = overview(long_view)
    assert ov["frames"] == FRAMES and ov["window"] == {"window": 2, "sink_chunks": 1}
    assert set(ov["curves"]) >= {"psnr", "tdiff", "shift_rate", "place_shift_rate", "revisit_psnr"}
    assert all(len(v) == FRAMES for v in ov["curves"].values())
    assert ov["curves"]["place_shift_rate"][:TINY.context_frames] == [None] * TINY.context_frames
    header, rows = table_rows(ov["head_table"], ov["layer_sensitivity"])
    assert len(rows) == TINY.layers * TINY.heads and len(header) == len(rows[0]) == 8
    only = {r["layer"]: r["psnr"] for r in ov["layer_sensitivity"]["rows"] if r["mode"] == "only"}
    assert [r[6] for r in rows] == [round(only[r[0]], 2) for r in rows]
    assert all("[" in r[2] for r in rows)  # quantwm gives each channel a width: mean [narrowest-widest]


def test_overview_handlers_show_the_strip_and_map_a_click(long_view):
    runs = Runs({"long": long_view})
    r = oh.overview_handler(runs, "long", 5)
    assert r["strip"].shape[1] == STRIP_WIDTH and len(r["rows"]) == TINY.layers * TINY.heads
    assert r["heatmap"] is not None and "through a rolling window of 2 chunk(s)" in r["status"]
    assert oh.strip_click_handler(runs, "long", STRIP_WIDTH - 1)["frame"] == FRAMES - 1
    for bad in (oh.strip_click_handler(runs, "long", STRIP_WIDTH), oh.strip_click_handler(runs, "none", 0),
                oh.overview_handler(runs, "long", FRAMES)):
        assert bad["status"].startswith("**Error:**") and "strip" not in bad and "frame" not in bad
