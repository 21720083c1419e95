"""The study tabs' handlers (app/study_handlers.py) on the Methods tab: its default choice, and VBench's
temporal-flickering score beside tdiff (the column, BF16's score, the status's sentence, the chart and the print
figure), called as plain functions (no browser, no server)."""
import re

import pytest

from app import study_handlers as sh
from app import world_handlers as wh
from quantwm.drivers.workbench import RunKey

pytestmark = pytest.mark.usefixtures("shared_rollouts")  # conftest.py: each rollout made once per process

FRAMES = 10


# `quantwm eval --methods quantwm,kivi --seeds 0,1 --frames 16` (2 bits): BF16 0.9108
REPORTED = [{"name": "quantwm", "vbench_flicker": 0.9079, "tdiff": 0.0117},
            {"name": "kivi", "vbench_flicker": 0.9019, "tdiff": 0.0303}]


def vbench_sentence_figures(status: str) -> dict:
    """The figures `sh.vbench_finding` states: BF16's score, the nearest and farthest method with their signed
    distance below BF16, the least and most flicker by tdiff."""
    def below(text):
        return 0.0 if text.startswith("level") else float(text.split()[0]) * (1 if " below " in text else -1)

    gap = r"(level with BF16|[\d.]+ (?:below|above) BF16)"
    m = re.search(rf"is ([\d.]+) for BF16 and from {gap} \(([^)]+)\) to {gap} \(([^)]+)\) for the methods, while "
                  r"tdiff, .*? measures ([\d.]+) \(([^)]+)\) to ([\d.]+) \(([^)]+)\): ", status)
    assert m, status
    b, g0, n0, g1, n1, t0, tn0, t1, tn1 = m.groups()
    return {"bf16": float(b), "near": (n0, below(g0)), "far": (n1, below(g1)), "tdiff": ((tn0, float(t0)),
                                                                                        (tn1, float(t1)))}


def test_the_vbench_sentence_changes_its_verdict_with_the_numbers():
    """Made-up rows: on the reported numbers VBench orders the methods as tdiff does (a quarter of tdiff's flicker
    registered); raise kivi's score past quantwm's and it orders them the other way; put quantwm above BF16 and it
    misses quantwm's flicker."""
    text = sh.vbench_finding(0.9108, REPORTED)
    assert vbench_sentence_figures(text) == {"bf16": 0.9108, "near": ("quantwm", 0.0029), "far": ("kivi", 0.0089),
                                             "tdiff": (("quantwm", 0.0117), ("kivi", 0.0303))}
    assert text.endswith("VBench orders the methods as tdiff does, so on these numbers it does tell them apart, "
                         "though it registers only 25% to 29% of the flicker tdiff measures.")  # 29/117, 89/303
    swapped = sh.vbench_finding(0.9108, [REPORTED[0], {**REPORTED[1], "vbench_flicker": 0.9089}])
    assert "VBench orders 1 of the 1 pair(s) of methods tdiff tells apart the other way or ties them (kivi, the most " \
           "flicker by tdiff, is VBench's steadiest), so VBench cannot tell these methods apart" in swapped
    tied = sh.vbench_finding(0.9108, [REPORTED[0], {**REPORTED[1], "vbench_flicker": 0.9079}])
    assert "orders 1 of the 1 pair(s)" in tied and "cannot tell these methods apart" in tied
    above = sh.vbench_finding(0.9108, [{**REPORTED[0], "vbench_flicker": 0.9110}, REPORTED[1]])
    assert vbench_sentence_figures(above)["near"] == ("quantwm", -0.0002)
    assert above.endswith("VBench scores quantwm as steady as BF16 or steadier although tdiff measures flicker in "
                          "it, so VBench misses that flicker, though it orders the methods as tdiff does.")
    assert sh.vbench_finding(0.9108, REPORTED[:1]).endswith(
        "0.0029 below BF16 for quantwm, while tdiff, in the same unit (the share of the pixel range a frame changes "
        "beyond BF16's change), measures 0.0117 (quantwm): VBench puts it below BF16 as tdiff does, registering 25% "
        "of the flicker tdiff measures.")


def test_the_methods_table_shows_each_run_s_vbench_flicker_and_the_sentence_quotes_the_table(runs):
    """The vbench_flicker column, beside tdiff, is VBench's score of each run's own frames from the last context
    frame on; BF16's is in the status (and a dashed line on the chart's panel); the sentence's figures are the
    table's."""
    from dataclasses import replace

    from quantwm.evaluation.vbench import temporal_flickering

    chosen = ["qvg-budget", "rtn", "kivi"]
    r = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, chosen, 2.5)
    h, wb = r["header"], runs.wb
    assert h.index("vbench_flicker") == h.index("tdiff") + 1, h
    ctx = wb.cfg.context_frames
    key = RunKey(seed=3, trajectory="pan-return", method="bf16", target="k", frames=FRAMES, budget=2.5)
    shown = {row[0]: (row[h.index("vbench_flicker")], row[h.index("tdiff")]) for row in r["rows"]}
    assert sorted(shown) == sorted(chosen)
    for m, (score, _) in shown.items():
        frames = wb.record(replace(key, method=m).id).frames
        assert score == round(temporal_flickering(frames[ctx - 1:]), 4), m
    bf16 = temporal_flickering(wb.record(key.reference().id).frames[ctx - 1:])
    assert r["bf16_vbench"] == bf16
    said = vbench_sentence_figures(r["status"])
    gaps = {m: round(round(bf16, 4) - s, 4) for m, (s, _) in shown.items()}
    near, far = min(gaps, key=gaps.get), max(gaps, key=gaps.get)
    least, most = min(shown, key=lambda m: shown[m][1]), max(shown, key=lambda m: shown[m][1])
    assert said == {"bf16": round(bf16, 4), "near": (near, gaps[near]), "far": (far, gaps[far]),
                    "tdiff": ((least, shown[least][1]), (most, shown[most][1]))}
    assert r["status"].count(sh.vbench_finding(bf16, [{"name": m, "vbench_flicker": s, "tdiff": t}
                                                      for m, (s, t) in shown.items()])) == 1
    panel = r["metrics"].index("vbench_flicker") + 1
    assert [t.name for t in r["figure"].data][panel - 1] == "vbench_flicker"
    lines = [s for s in r["figure"].layout.shapes if s.x0 == s.x1 == bf16]
    assert len(lines) == 1 and lines[0].xref == f"x{panel}" and lines[0].label.text == "BF16"


def test_the_exported_methods_figure_draws_bf16_s_vbench_score(runs, monkeypatch):
    from quantwm.evaluation import figures as FG

    saved, save = [], FG.save_figure
    monkeypatch.setattr(FG, "save_figure", lambda fig, stem, formats: saved.append(fig) or save(fig, stem, formats))
    chosen = ["qvg-budget", "rtn", "kivi"]
    shown = sh.methods_handler(runs, 3, "pan-return", "k", FRAMES, chosen, 2.5)
    sh.export_methods_handler(runs, 3, "pan-return", "k", FRAMES, chosen, 2.5, ["svg"])
    ax = saved[0].axes[shown["metrics"].index("vbench_flicker")]
    assert ax.get_title() == "vbench_flicker"
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [shown["bf16_vbench"]] * 2
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"BF16 {shown['bf16_vbench']:.4f}"]


def test_the_methods_tab_ticks_the_compared_methods_and_offers_every_one(wb):
    """The default choice is the strongest published baselines, textbook and quantwm among what the model runs
    (kvquant quantizes Keys before RoPE: not on the built-in model), each fitting the default budget (none ticked
    only to be left out); every other method stays a choice."""
    import gradio as gr

    from app.studies_tab import build_methods_tab
    from quantwm.core.budget import fit_methods

    methods = wb.methods()
    default = sh.default_methods(methods)
    assert default == ["kivi", "turboquant", "qvg", "textbook", "quantwm"]
    span = wb.cfg.chunk_frames * wb.cfg.tokens_per_frame
    assert fit_methods(default, wh.DEFAULT_BUDGET, wh.DEFAULT_BUDGET, wb.cfg.head_dim, span, "kv") == (default, {})
    with gr.Blocks() as demo:
        controls = {name: gr.Textbox() for name in ("seed", "trajectory", "target", "frames")}
        build_methods_tab(lambda *a, **k: {}, lambda *a, **k: {}, methods, controls, ("pdf",))
    choice = next(c["props"] for c in demo.config["components"] if c["props"].get("elem_id") == "methods-choice")
    assert choice["value"] == default
    assert [c[0] if isinstance(c, (list, tuple)) else c for c in choice["choices"]] == [m for m in methods if m != "bf16"]
