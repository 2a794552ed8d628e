// Small SVG charts for the dashboard: no library, no build step. Every chart is redrawn whole on each
// poll (a few dozen elements), which is simpler than diffing and costs nothing at one update a second.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const CHART_W = 520, CHART_H = 190, PAD = {left: 46, right: 12, top: 18, bottom: 24};

function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, value);
  if (text !== undefined) el.textContent = text;
  return el;
}

function frame(container) {
  const svg = svgEl("svg", {viewBox: `0 0 ${CHART_W} ${CHART_H}`, role: "img"});
  container.replaceChildren(svg);
  return svg;
}

function scales(opts) {
  const plotW = CHART_W - PAD.left - PAD.right, plotH = CHART_H - PAD.top - PAD.bottom;
  const xSpan = (opts.xMax - opts.xMin) || 1, ySpan = (opts.yMax - opts.yMin) || 1;
  return {
    x: (v) => PAD.left + ((v - opts.xMin) / xSpan) * plotW,
    y: (v) => PAD.top + plotH - ((v - opts.yMin) / ySpan) * plotH,
  };
}

function axes(svg, opts, sc) {
  const ticks = opts.yTicks || 4;
  for (let i = 0; i <= ticks; i++) {
    const v = opts.yMin + (i / ticks) * (opts.yMax - opts.yMin);
    const y = sc.y(v);
    svg.appendChild(svgEl("line", {x1: PAD.left, x2: CHART_W - PAD.right, y1: y, y2: y, class: "grid"}));
    svg.appendChild(svgEl("text", {x: PAD.left - 6, y: y + 4, class: "tick", "text-anchor": "end"},
                          opts.yFormat(v)));
  }
  for (const [v, label] of opts.xTicks || []) {
    svg.appendChild(svgEl("text", {x: sc.x(v), y: CHART_H - 6, class: "tick", "text-anchor": "middle"}, label));
  }
}

// An SVG path through the points; a null y lifts the pen (a step line first runs on to that x: the value held
// until then).
function pathOf(points, sc, step) {
  let d = "", down = false;
  for (const [x, y] of points) {
    const px = sc.x(x).toFixed(1);
    if (y === null || y === undefined) {
      if (down && step) d += `H${px}`;
      down = false;
      continue;
    }
    const py = sc.y(y).toFixed(1);
    if (!down) d += `M${px},${py}`;
    else d += step ? `H${px}V${py}` : `L${px},${py}`;
    down = true;
  }
  return d;
}

// series: [{name, color, points: [[x, y], ...], step}]; bands: [[x0, x1]] shaded (e.g. a hot accelerator)
function lineChart(container, opts) {
  const svg = frame(container);
  const sc = scales(opts);
  for (const [x0, x1] of opts.bands || []) {
    const left = sc.x(Math.max(x0, opts.xMin)), right = sc.x(Math.min(x1, opts.xMax));
    if (right > left) {
      svg.appendChild(svgEl("rect", {x: left, y: PAD.top, width: right - left,
                                     height: CHART_H - PAD.top - PAD.bottom, class: "band"}));
    }
  }
  axes(svg, opts, sc);
  for (const s of opts.series) {
    const d = pathOf(s.points, sc, s.step);
    if (d) svg.appendChild(svgEl("path", {d, stroke: s.color, class: "series", "data-series": s.name}));
  }
  if (opts.empty && !opts.series.some((s) => s.points.some(([, y]) => y !== null && y !== undefined))) {
    svg.appendChild(svgEl("text", {x: CHART_W / 2, y: CHART_H / 2, class: "empty", "text-anchor": "middle"},
                          opts.empty));
  }
}

// bars: [{label, value, color, title}]
function barChart(container, opts) {
  const svg = frame(container);
  const n = Math.max(opts.bars.length, 1);
  const sc = scales({...opts, xMin: 0, xMax: n});
  axes(svg, opts, sc);
  const slot = sc.x(1) - sc.x(0);
  opts.bars.forEach((bar, i) => {
    const top = sc.y(Math.min(bar.value, opts.yMax)), base = sc.y(opts.yMin);
    const rect = svgEl("rect", {x: sc.x(i) + slot * 0.15, y: top, width: slot * 0.7, height: base - top,
                                fill: bar.color, class: "bar", "data-position": bar.label});
    rect.appendChild(svgEl("title", {}, bar.title));
    svg.appendChild(rect);
    svg.appendChild(svgEl("text", {x: sc.x(i) + slot / 2, y: CHART_H - 6, class: "tick", "text-anchor": "middle"},
                          bar.label));
    svg.appendChild(svgEl("text", {x: sc.x(i) + slot / 2, y: top - 4, class: "value", "text-anchor": "middle"},
                          opts.yFormat(bar.value)));
  });
  if (!opts.bars.length && opts.empty) {
    svg.appendChild(svgEl("text", {x: CHART_W / 2, y: CHART_H / 2, class: "empty", "text-anchor": "middle"},
                          opts.empty));
  }
}

// The smallest round axis top (4 ticks of 1, 2, 2.5 or 5 x 10^k) that holds `value`.
function niceMax(value, ticks = 4) {
  const raw = Math.max(value, 1e-9) / ticks;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
  return step * ticks;
}

window.MirrorCharts = {lineChart, barChart, niceMax};
