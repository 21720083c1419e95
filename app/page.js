() => {
  // Click a point of the per-frame plot: move the frame slider there (its change event scrubs both runs).
  // Play, pause and seek of either video are mirrored on the other, so both play in lockstep.
  // A newly loaded pair opens on the run's worst flicker frame (named in the status line), not on frame 0.
  // The frame slider seeks both (paused) videos to its frame, and a dashed line marks it on the per-frame plot.
  const FPS = 8;  // app/media.py writes the videos at 8 frames per second
  const showWorst = (v) => {
    const m = /Worst flicker frames: (\d+)/.exec(document.querySelector('#generate-status')?.innerText || '');
    if (m && v.paused && v.currentTime === 0) v.currentTime = (Number(m[1]) + 0.5) / FPS;
  };
  const setSlider = (frame) => {
    const box = document.querySelector('#frame-slider input[type="number"]');
    const range = document.querySelector('#frame-slider input[type="range"]');
    for (const el of [box, range]) {
      if (!el) continue;
      el.value = frame;
      el.dispatchEvent(new Event('input', { bubbles: true }));
      el.dispatchEvent(new Event('change', { bubbles: true }));
    }
    if (range) range.dispatchEvent(new PointerEvent('pointerup', { bubbles: true }));
  };
  const hookPlot = () => {
    const gd = document.querySelector('#frame-plot .js-plotly-plot');
    if (gd && gd.on && !gd.__quantwmHooked) {
      gd.__quantwmHooked = true;
      gd.on('plotly_click', (ev) => {
        if (ev && ev.points && ev.points.length) setSlider(Math.round(ev.points[0].x));
      });
    }
  };
  const hookVideos = () => {
    const a = document.querySelector('#video-bf16 video');
    const b = document.querySelector('#video-method video');
    for (const v of [a, b]) {
      if (v && !v.__quantwmWorst) {
        v.__quantwmWorst = true;
        v.addEventListener('loadedmetadata', () => showWorst(v));
        if (v.readyState >= 1) showWorst(v);
      }
    }
    if (!a || !b || (a.__quantwmPair === b)) return;
    a.__quantwmPair = b; b.__quantwmPair = a;
    for (const [x, y] of [[a, b], [b, a]]) {
      x.addEventListener('play', () => { if (y.paused) { y.currentTime = x.currentTime; y.play(); } });
      x.addEventListener('pause', () => { if (!y.paused) y.pause(); });
      x.addEventListener('seeked', () => { if (Math.abs(y.currentTime - x.currentTime) > 0.05) y.currentTime = x.currentTime; });
    }
  };
  // Moving the frame slider seeks both videos to that frame (a paused pair only: playing videos keep playing).
  const seekVideos = (frame) => {
    for (const sel of ['#video-bf16 video', '#video-method video']) {
      const v = document.querySelector(sel);
      if (v && v.paused && Number.isFinite(frame)) v.currentTime = (frame + 0.5) / FPS;
    }
  };
  const hookSlider = () => {
    for (const el of document.querySelectorAll('#frame-slider input')) {
      if (el.__quantwmSeek) continue;
      el.__quantwmSeek = true;
      el.addEventListener('change', () => { seekVideos(Number(el.value)); markFrame(); });
      el.addEventListener('input', () => { try { markFrame(); } catch (e) { /* the plot is not drawn yet */ } });
    }
  };
  // A dashed line on the per-frame plot at the slider's frame, moved whenever the slider or the plot changes.
  const markFrame = () => {
    const gd = document.querySelector('#frame-plot .js-plotly-plot');
    const fl = gd && gd._fullLayout;
    const frame = Number(document.querySelector('#frame-slider input[type="number"]')?.value);
    if (!fl || !fl.xaxis || !fl._size || !Number.isFinite(frame)) return;
    let line = gd.querySelector('.quantwm-frame-line');
    if (!line) {
      line = document.createElement('div');
      line.className = 'quantwm-frame-line';
      line.style.cssText = 'position:absolute;width:0;border-left:2px dashed #000;pointer-events:none;z-index:5';
      if (getComputedStyle(gd).position === 'static') gd.style.position = 'relative';
      gd.appendChild(line);
    }
    line.style.left = (fl._size.l + fl.xaxis.l2p(frame)) + 'px';
    line.style.top = fl._size.t + 'px';
    line.style.height = fl._size.h + 'px';
  };
  // Every plot follows its box's width (a window resize, a tab shown, a row that wraps): Plotly's own responsive
  // handler hears window resizes only, and a plot drawn in a hidden tab kept the width it had there.
  const resized = new ResizeObserver((entries) => {
    for (const e of entries) {
      const gd = e.target.querySelector('.js-plotly-plot');
      const w = Math.round(e.contentRect.width);
      if (!gd || !gd._fullLayout || !window.Plotly || w === 0 || w === e.target.__quantwmWidth) continue;
      e.target.__quantwmWidth = w;
      window.Plotly.Plots.resize(gd);
    }
  });
  const hookPlotSizes = () => {
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
      const box = gd.parentElement;
      if (box && !box.__quantwmSized) { box.__quantwmSized = true; resized.observe(box); }
    }
  };
  new MutationObserver(() => {
    hookPlot(); hookVideos(); hookPlotSizes();
    try { hookSlider(); markFrame(); } catch (e) { console.warn('quantwm: frame hooks', e); }
  }).observe(document.body, { childList: true, subtree: true });
}
