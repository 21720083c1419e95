() => {
  // Click a point of the per-frame plot: move the frame slider there (its change event scrubs every run).
  // Play, pause and seek of any video are mirrored on the others (BF16, method A, method B), so all play in lockstep.
  // Newly loaded videos open on method A's worst flicker frame (named in the status line), not on frame 0.
  // The frame slider seeks every (paused) video to its frame, and a dashed line marks it on the per-frame plot.
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
  // Every player: BF16's, method A's and method B's (when shown).
  const VIDEOS = ['#video-bf16 video', '#video-method video', '#video-method-b video'];
  const videos = () => VIDEOS.map((s) => document.querySelector(s)).filter((v) => v);
  const hookVideos = () => {
    for (const v of videos()) {
      if (!v.__quantwmWorst) {
        v.__quantwmWorst = true;
        v.addEventListener('loadedmetadata', () => showWorst(v));
        if (v.readyState >= 1) showWorst(v);
      }
      if (v.__quantwmSync) continue;
      // play, pause and seek of one player are mirrored on every other shown now, so all play in lockstep
      v.__quantwmSync = true;
      const others = () => videos().filter((o) => o !== v);
      v.addEventListener('play', () => { for (const o of others()) if (o.paused) { o.currentTime = v.currentTime; o.play(); } });
      v.addEventListener('pause', () => { for (const o of others()) if (!o.paused) o.pause(); });
      v.addEventListener('seeked', () => {
        for (const o of others()) if (Math.abs(o.currentTime - v.currentTime) > 0.05) o.currentTime = v.currentTime;
      });
    }
  };
  // Moving the frame slider seeks every (paused) video to that frame (playing videos keep playing).
  const seekVideos = (frame) => {
    for (const v of videos()) {
      if (v.paused && Number.isFinite(frame)) v.currentTime = (frame + 0.5) / FPS;
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
