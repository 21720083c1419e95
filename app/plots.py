"""Plotly figures of the app, built from plain lists and numpy arrays (no torch, no numerics)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEAD_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf", "#393b79", "#ad494a")
BAR_ROW_PX = 24  # the height of a bar's line in `bars_figure`: a 12 px name with room above and below


RUN_STYLES = (("#1f77b4", "solid", "circle"), ("#d62728", "dot", "diamond"))  # method A, method B: colour, dash, marker
PANELS = (("tdiff", "flicker (tdiff-L1 vs BF16; higher = worse)"),
          ("warp_error", "warping error above BF16's (0 = BF16; lower is better)"),
          ("psnr", "PSNR vs BF16 (dB)"), ("shift_rate", "top-1 shift rate"))


def frame_series_figure(series: dict, worst: list[int], context_frames: int, current: int | None = None,
                        label: str = "method", more: tuple = ()) -> go.Figure:
    """Stacked per-frame panels (tdiff, warping error, PSNR vs BF16, shift rate) of a run against BF16, and of the
    runs in `more` ((label, series, worst) each, against the same BF16) overlaid on the same panels: each run in its
    colour, dash and marker (`RUN_STYLES`), named once in the legend; one y-range per panel over every run shown, so
    they compare on one scale. Worst frames marked; frames identical to BF16 drawn as open squares at the top of
    the PSNR panel (no PSNR, no cap); click = frame."""
    shown = [(label, series, worst), *more]
    panels = [p for p in PANELS if p[0] in series]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=[p[1] for p in panels])
    for row, (name, _) in enumerate(panels, 1):
        for i, (run, s, bad) in enumerate(shown):
            _run_panel(fig, row, name, run, s, bad, RUN_STYLES[i % len(RUN_STYLES)], context_frames, first=i == 0)
        lo, hi = _shared_range([v for _, s, _ in shown for v in s[name] if v is not None], name != "psnr")
        fig.update_yaxes(range=[lo, hi], autorange=False, row=row, col=1)
    for i, (run, _, _) in enumerate(shown):  # the legend names each run once, in its style
        color, dash, symbol = RUN_STYLES[i % len(RUN_STYLES)]
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines+markers", name=run, legendgroup=run,
                                 hoverinfo="skip", line=dict(color=color, dash=dash), marker=dict(symbol=symbol)),
                      row=1, col=1)
    _coverage(fig, series.get("seen_by_context"), context_frames, len(panels))
    if current is not None:
        fig.add_vline(x=current, line_dash="dot", line_color="black")
    fig.update_xaxes(title_text="frame (click a point to jump there)", row=len(panels), col=1)
    fig.update_layout(height=140 * len(panels) + 60 + 20 * len(shown), margin=dict(l=50, r=10, t=40, b=40),
                      clickmode="event", legend=dict(orientation="h", y=-0.14), hovermode="closest")
    fig.update_annotations(font_size=11)  # the panel titles fit the panel's width
    return fig


def _run_panel(fig: go.Figure, row: int, name: str, run: str, series: dict, worst: list[int], style: tuple,
               context_frames: int, first: bool) -> None:
    """One run's curve on one panel (its trace named after the metric, grouped under the run in the legend), its
    worst flicker frames on the flicker panel, its frames identical to BF16 on the PSNR panel."""
    color, dash, symbol = style
    y = series[name]
    x = list(range(len(y)))
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, legendgroup=run, showlegend=False,
                             line=dict(color=color, dash=dash), marker=dict(size=6, symbol=symbol),
                             hovertemplate=f"{run}: frame %{{x}}: %{{y:.4g}}<extra>{name}</extra>"), row=row, col=1)
    wx = [t for t in worst if y[t] is not None] if name == "tdiff" else []  # marked where flicker is drawn
    if wx:
        fig.add_trace(go.Scatter(x=wx, y=[y[t] for t in wx], mode="markers", name="worst flicker frames",
                                 legendgroup="worst", showlegend=first,
                                 marker=dict(symbol="x", size=13, color="black", line=dict(color=color, width=1)),
                                 hovertemplate=f"{run}: worst frame %{{x}}<extra></extra>"), row=row, col=1)
    finite = [v for v in y if v is not None]
    same = [t for t, v in enumerate(series.get("identical") or []) if v and t >= context_frames]
    if name == "psnr" and same and finite:
        fig.add_trace(go.Scatter(x=same, y=[max(finite)] * len(same), mode="markers", name="identical to BF16",
                                 legendgroup="identical", showlegend=first,
                                 marker=dict(symbol="square-open", size=9, color=color),
                                 hovertemplate=f"{run}: frame %{{x}}: identical to BF16<extra></extra>"), row=row, col=1)


def _shared_range(values: list[float], from_zero: bool) -> tuple[float, float]:
    """One panel's y-range over every run's values: from 0 for a non-negative metric (flicker, warping error,
    shift rate), else from the smallest value; 5% of the span above and below."""
    if not values:
        return 0.0, 1.0
    lo, hi = (0.0 if from_zero else min(values)), max(values)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1e-3
    return (lo if from_zero else lo - pad), hi + pad


def _coverage(fig: go.Figure, seen: list | None, context_frames: int, rows: int) -> None:
    """The context frames shaded grey on each of the `rows` panels; the generated frames shaded by what the context
    saw, named in the legend. The shapes are plain layout dicts, added at once (what `add_vrect` makes, without its
    per-shape validation: 0.07 s a shaded span, most of a Generate's time when its runs are cached)."""
    runs = _coverage_runs(seen, context_frames)
    spans = [(-0.5, context_frames - 0.5, "grey", 0.15),
             *((a - 0.5, b + 0.5, "#2ca02c" if kind == "memory" else "#ff7f0e", 0.12) for kind, a, b in runs)]
    axes = ["" if r == 1 else str(r) for r in range(1, rows + 1)]
    shapes = [dict(type="rect", xref=f"x{n}", yref=f"y{n} domain", x0=x0, x1=x1, y0=0, y1=1, fillcolor=color,
                   opacity=opacity, line=dict(width=0)) for x0, x1, color, opacity in spans for n in axes]
    notes = [dict(text="context", x=-0.5, xref=f"x{n}", y=0, yref=f"y{n} domain", xanchor="left", yanchor="bottom",
                  showarrow=False, font=dict(size=10)) for n in axes]
    fig.update_layout(shapes=[*fig.layout.shapes, *shapes], annotations=[*fig.layout.annotations, *notes])
    shown = {kind for kind, _, _ in runs}
    for kind, color, label in (("memory", "#2ca02c", "memory: the context saw it all (should match)"),
                               ("invented", "#ff7f0e", "places the context never saw (invented by the model)")):
        if kind in shown:
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label, hoverinfo="skip",
                                     marker=dict(symbol="square", size=10, color=color, opacity=0.4)), row=1, col=1)


def _coverage_runs(seen: list | None, context_frames: int) -> list[tuple[str, int, int]]:
    """Consecutive generated frames grouped as ("memory", first, last) where the context frames saw the whole
    view, or ("invented", first, last) where part of it is new to the model."""
    runs: list[tuple[str, int, int]] = []
    for t, share in enumerate(seen or []):
        if t < context_frames or share is None:
            continue
        kind = "memory" if share >= 1 else "invented"
        if runs and runs[-1][0] == kind and runs[-1][2] == t - 1:
            runs[-1] = (kind, runs[-1][1], t)
        else:
            runs.append((kind, t, t))
    return runs


def logit_heatmaps_figure(exact: np.ndarray, stored: np.ndarray, src_exact: tuple, src_stored: tuple,
                          method: str, grid_width: int) -> go.Figure:
    """Logits over the cache (frames x positions) with exact keys, stored keys, and their difference;
    the top-1 sources (frame, row, col) are marked at position row * grid_width + col."""
    diff = stored - exact  # NaN rows: frames the cache did not hold (a sliding window), drawn as gaps
    lim = float(np.nanmax(np.abs(diff))) or 1.0
    lo, hi = float(min(np.nanmin(exact), np.nanmin(stored))), float(max(np.nanmax(exact), np.nanmax(stored)))
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("BF16 keys", f"{method} keys", f"{method} − BF16"))
    kw = dict(x=list(range(exact.shape[1])), y=list(range(exact.shape[0])))
    fig.add_trace(go.Heatmap(z=exact, zmin=lo, zmax=hi, colorscale="Viridis", showscale=False, **kw), 1, 1)
    fig.add_trace(go.Heatmap(z=stored, zmin=lo, zmax=hi, colorscale="Viridis", colorbar=dict(x=0.63, len=0.9),
                             **kw), 1, 2)
    fig.add_trace(go.Heatmap(z=diff, zmin=-lim, zmax=lim, colorscale="RdBu", reversescale=True,
                             colorbar=dict(x=1.0, len=0.9), **kw), 1, 3)
    for col in (1, 2, 3):
        for (f, r, c), sym, color, name in ((src_exact, "circle-open", "white", "BF16 top-1"),
                                            (src_stored, "x-open", "red", f"{method} top-1")):
            fig.add_trace(go.Scatter(x=[r * grid_width + c], y=[f], mode="markers", name=name, showlegend=False,
                                     marker=dict(symbol=sym, size=14, color=color, line=dict(width=3))), 1, col)
    for sym, color, name in (("circle-open", "#333333", "BF16 top-1 (white circle)"),  # white shows on the heatmap,
                             ("x-open", "red", f"{method} top-1 (red cross)")):      # not on the legend's white
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                                 marker=dict(symbol=sym, size=12, color=color, line=dict(width=3))), 1, 1)
        fig.update_xaxes(title_text="position (row*w + col)", row=1, col=col)
    fig.update_yaxes(title_text="cached frame", row=1, col=1)
    fig.update_layout(height=340, margin=dict(l=50, r=10, t=50, b=40), legend=dict(orientation="h", y=-0.3))
    return fig


def energy_figure(spectra: list[dict], layer: int, rank: int = 8) -> go.Figure:
    """One layer's eigen spectrum (log) and cumulative energy per head, top-`rank` marked."""
    s = spectra[layer]
    ev, cum, top = s["eigenvalues"], s["cumulative"], s["top_fraction"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"layer {layer}: eigenvalues of S = E[q qᵀ]",
                                                        "cumulative energy"))
    idx = list(range(1, ev.shape[1] + 1))
    for h in range(ev.shape[0]):  # one colour per head in both panels, one legend entry per head
        color = HEAD_COLORS[h % len(HEAD_COLORS)]
        fig.add_trace(go.Scatter(x=idx, y=ev[h], mode="lines", name=f"head {h} (top-{rank} {top[h]:.0%})",
                                 legendgroup=str(h), line=dict(color=color)), 1, 1)
        fig.add_trace(go.Scatter(x=idx, y=cum[h], mode="lines", name=f"head {h}", legendgroup=str(h),
                                 showlegend=False, line=dict(color=color),
                                 hovertemplate=f"head {h}: top-{rank} {top[h]:.1%}<extra></extra>"), 1, 2)
    fig.add_vline(x=rank, line_dash="dash", line_color="black", annotation_text=f"R={rank}", row=1, col=2)
    fig.add_vline(x=rank, line_dash="dash", line_color="black", row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(range=[0, 1.02], row=1, col=2)
    fig.update_xaxes(title_text="eigen-direction (descending)")
    fig.update_layout(height=360 + 18 * ((ev.shape[0] + 3) // 4), margin=dict(l=50, r=10, t=40, b=40),
                      legend=dict(orientation="h", y=-0.25))  # below the panels, in rows: no scrolling
    return fig


def bars_figure(rows: list[dict], label: str, metrics: list[str], title: str) -> go.Figure:
    """One panel per metric, a horizontal bar per row (in the rows' order, top to bottom), every row named by
    `label` on the panels' shared axis: each name is a tick of its own (no name skipped for room) on a line of
    its own height."""
    names = [r[label] for r in rows]
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics, shared_yaxes=True,
                        horizontal_spacing=0.03)
    for i, m in enumerate(metrics, 1):
        fig.add_trace(go.Bar(y=names, x=[r[m] for r in rows], orientation="h", name=m, showlegend=False,
                             hovertemplate="%{y}: %{x:.4g}<extra>" + m + "</extra>"), 1, i)
    fig.update_yaxes(type="category", tickmode="array", tickvals=names, ticktext=names, autorange="reversed",
                     automargin=True)
    fig.update_xaxes(nticks=3)  # narrow panels: a few round values each
    fig.update_layout(height=max(300, BAR_ROW_PX * len(rows) + 110), title=title, margin=dict(l=10, r=10, t=70, b=30))
    return fig


def key_value_figure(by: dict, metrics: list[tuple[str, str]], title: str) -> go.Figure:
    """Keys only (k) vs Values only (v) per method: one panel per metric (column, title), bars of the mean over
    the seeds with the standard deviation as error bars. `by`: {(method, target): [per-seed rows]}."""
    methods = list(dict.fromkeys(m for m, _ in by))
    cols = min(4, len(metrics))
    fig = make_subplots(rows=-(-len(metrics) // cols), cols=cols, subplot_titles=[t for _, t in metrics],
                        vertical_spacing=0.16)
    for i, (col, _) in enumerate(metrics):
        for target, name, color in (("k", "Keys only", "#d62728"), ("v", "Values only", "#1f77b4")):
            stats = [np.array([r[col] for r in by[(m, target)]], dtype=float) for m in methods]
            fig.add_trace(go.Bar(x=methods, y=[s.mean() for s in stats], name=name, legendgroup=target,
                                 showlegend=i == 0, marker_color=color,
                                 error_y=dict(type="data", array=[s.std(ddof=1) if len(s) > 1 else 0 for s in stats])),
                          i // cols + 1, i % cols + 1)
    # the legend right of the panels, where no panel's title is (above them it covered the first row's)
    fig.update_layout(height=260 * (-(-len(metrics) // cols)) + 60, title=title, barmode="group",
                      margin=dict(l=40, r=10, t=80, b=30),
                      legend=dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top"))
    return fig
