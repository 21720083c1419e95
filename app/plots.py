"""Plotly figures of the app, built from plain lists and numpy arrays (no torch, no numerics)."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEAD_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf", "#393b79", "#ad494a")
BAR_ROW_PX = 24  # the height of a bar's line in `bars_figure`: a 12 px name with room above and below


def frame_series_figure(series: dict, worst: list[int], context_frames: int, current: int | None = None) -> go.Figure:
    """Stacked per-frame panels (tdiff, warping error, PSNR vs BF16, shift rate); worst frames marked; frames
    identical to BF16 drawn as open squares at the top of the PSNR panel (no PSNR, no cap); click = frame."""
    n = len(series["tdiff"])
    x = list(range(n))
    panels = [("tdiff", "#d62728", "flicker (tdiff-L1 vs BF16; higher = worse)"),
              ("warp_error", "#ff7f0e", "warping error above BF16's (0 = BF16; lower is better)"),
              ("psnr", "#1f77b4", "PSNR vs BF16 (dB)"), ("shift_rate", "#9467bd", "top-1 shift rate")]
    panels = [p for p in panels if p[0] in series]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=[p[2] for p in panels])
    for row, (name, color, _) in enumerate(panels, 1):
        y = series[name]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, line=dict(color=color),
                                 marker=dict(size=6), hovertemplate="frame %{x}: %{y:.4g}<extra>" + name + "</extra>"),
                      row=row, col=1)
        wx = [t for t in worst if y[t] is not None] if name == "tdiff" else []  # marked where flicker is drawn
        if wx:
            fig.add_trace(go.Scatter(x=wx, y=[y[t] for t in wx], mode="markers", name="worst flicker frames",
                                     marker=dict(symbol="x", size=13, color="black"),
                                     hovertemplate="worst frame %{x}<extra></extra>"), row=row, col=1)
        finite = [v for v in y if v is not None]
        same = [t for t, v in enumerate(series.get("identical") or []) if v and t >= context_frames]
        if name == "psnr" and same and finite:
            fig.add_trace(go.Scatter(x=same, y=[max(finite)] * len(same), mode="markers", name="identical to BF16",
                                     marker=dict(symbol="square-open", size=9, color="grey"),
                                     hovertemplate="frame %{x}: identical to BF16<extra></extra>"), row=row, col=1)
    fig.add_vrect(x0=-0.5, x1=context_frames - 0.5, fillcolor="grey", opacity=0.15, line_width=0,
                  annotation_text="context", annotation_position="bottom left", annotation_font_size=10)
    for kind, a, b in _coverage_runs(series.get("seen_by_context"), context_frames):
        fig.add_vrect(x0=a - 0.5, x1=b + 0.5, line_width=0, opacity=0.12,
                      fillcolor="#2ca02c" if kind == "memory" else "#ff7f0e")
    shown = {kind for kind, _, _ in _coverage_runs(series.get("seen_by_context"), context_frames)}
    for kind, color, label in (("memory", "#2ca02c", "memory: the context saw it all (should match)"),
                               ("invented", "#ff7f0e", "places the context never saw (invented by the model)")):
        if kind in shown:
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label, hoverinfo="skip",
                                     marker=dict(symbol="square", size=10, color=color, opacity=0.4)), row=1, col=1)
    if current is not None:
        fig.add_vline(x=current, line_dash="dot", line_color="black")
    fig.update_xaxes(title_text="frame (click a point to jump there)", row=len(panels), col=1)
    fig.update_layout(height=140 * len(panels) + 60, margin=dict(l=50, r=10, t=40, b=40), clickmode="event",
                      legend=dict(orientation="h", y=-0.14), hovermode="closest")
    fig.update_annotations(font_size=11)  # the panel titles fit the panel's width
    return fig


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
