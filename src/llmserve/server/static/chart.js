// A small line chart on a canvas: time on x (the last `span` seconds), an auto-scaled y axis from
// zero, one coloured line per series with its legend. Redrawn whole on every update.

const COLORS = ["#2f6fde", "#e8702a", "#2a9d5c", "#b548c6", "#d4a017", "#0e9aa7"];

/** A y-axis maximum with round steps: 1, 2 or 5 times a power of ten, four steps. */
function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = value / 4;
  const power = 10 ** Math.floor(Math.log10(step));
  const nice = [1, 2, 5, 10].find((m) => m * power >= step);
  return nice * power * 4;
}

function formatValue(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 1000) return `${(v / 1000).toFixed(v >= 10000 ? 0 : 1)}k`;
  return Number.isInteger(v) ? String(v) : v.toFixed(Math.abs(v) < 1 ? 2 : 1);
}

export class LineChart {
  constructor(canvas, { span = 120, yMax = null } = {}) {
    this.canvas = canvas;
    this.span = span; // seconds shown
    this.yMax = yMax; // a fixed top (percentages), else scaled to the data
  }

  /** `series`: {label: [[timeInSeconds, value], ...]}; `now`: the right edge, in seconds. */
  draw(series, now) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    const style = getComputedStyle(document.documentElement);
    const text = style.getPropertyValue("--muted").trim();
    const grid = style.getPropertyValue("--line").trim();
    ctx.font = "11px system-ui, sans-serif";

    const pad = { left: 44, right: 10, top: 22, bottom: 20 };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    const entries = Object.entries(series);
    const visible = entries.flatMap(([, points]) => points.filter(([t]) => t >= now - this.span));
    const top = this.yMax ?? niceMax(Math.max(0, ...visible.map(([, v]) => v)));
    const x = (t) => pad.left + plotW * (1 - (now - t) / this.span);
    const y = (v) => pad.top + plotH * (1 - v / top);

    // grid and axes: four horizontal lines with their values; time marks every 30 s
    ctx.strokeStyle = grid;
    ctx.fillStyle = text;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = (top * i) / 4;
      ctx.beginPath();
      ctx.moveTo(pad.left, Math.round(y(v)) + 0.5);
      ctx.lineTo(pad.left + plotW, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.fillText(formatValue(v), pad.left - 6, y(v));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let ago = 0; ago <= this.span; ago += 30) {
      ctx.fillText(ago ? `-${ago}s` : "now", x(now - ago), pad.top + plotH + 6);
    }

    // the lines, then the legend above the plot
    let drawn = 0;
    let legendX = pad.left;
    entries.forEach(([label, points], i) => {
      const color = COLORS[i % COLORS.length];
      const shown = points.filter(([t]) => t >= now - this.span);
      ctx.strokeStyle = color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      shown.forEach(([t, v], j) => (j ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      ctx.stroke();
      drawn += shown.length;
      ctx.fillStyle = color;
      ctx.fillRect(legendX, 6, 10, 10);
      ctx.fillStyle = text;
      ctx.textAlign = "left";
      ctx.fillText(label, legendX + 14, 5);
      legendX += 24 + ctx.measureText(label).width;
    });
    canvas.dataset.points = String(drawn); // what was drawn, for tests
  }
}
