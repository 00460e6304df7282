// The plan report's script (distgraph/plan/report.py inlines it): draws the plan's
// figures, read from the JSON in #plan-data, as plain SVG and HTML. Nothing is fetched.
// Every printed number keeps its exact value in data-value (the tests read them).
"use strict";

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 1180;
const KIND_COLORS = {F: "#4c9be8", B: "#e8874c", I: "#e8874c", W: "#b05cc6",
                     update: "#59a14f", prologue: "#9aa3b5", send: "#8d8d8d",
                     recv: "#c2c2c2"};
const MEMORY_PARTS = [["parameters", "#4c78a8"], ["states", "#72b7b2"],
                      ["gradients", "#f58518"], ["activations", "#e45756"],
                      ["workspace", "#b279a2"]];
const STEP_PARTS = [["compute", "#4c78a8"], ["communication", "#f58518"],
                    ["bubble", "#d5d9e0"]];

// ---- elements ---------------------------------------------------------------------------
function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of [].concat(children || [])) {
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- numbers, as distgraph prints them --------------------------------------------------
function sig(x, digits) {
  return String(Number(x.toPrecision(digits)));
}

function fmtTime(s) {
  return s >= 1 ? `${sig(s, 4)} s` : `${sig(s * 1e3, 4)} ms`;
}

// decimal units, as distgraph.units.fmt_bytes and the resource file's GB
function fmtBytes(n) {
  for (const [unit, size] of [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]]) {
    if (n >= size) {
      const v = n / size;
      return v < 100 ? `${sig(v, 3)} ${unit}` : `${Math.round(v)} ${unit}`;
    }
  }
  return `${Math.round(n)} B`;
}

function fmtFlops(x) {
  for (const [unit, size] of [["PFLOP", 1e15], ["TFLOP", 1e12], ["GFLOP", 1e9],
                              ["MFLOP", 1e6], ["kFLOP", 1e3]]) {
    if (x >= size) return `${sig(x / size, 4)} ${unit}`;
  }
  return `${sig(x, 4)} FLOP`;
}

function fmtRate(x) {
  for (const [unit, size] of [["TFLOP/s", 1e12], ["GFLOP/s", 1e9]]) {
    if (x >= size) return `${sig(x / size, 3)} ${unit}`;
  }
  return `${sig(x / 1e6, 3)} MFLOP/s`;
}

function fmtShare(x) {
  return `${(x * 100).toFixed(2)}%`;
}

// A printed figure: its text, and its exact value for whoever reads the page's numbers.
function fig(key, value, format) {
  return el("span", {"class": "fig", "data-key": key, "data-value": String(value)},
            format(value));
}

function stageColor(s) {
  return s < 0 ? "#dde1e8" : `hsl(${(s * 137.508) % 360}, 58%, ${s % 2 ? 48 : 60}%)`;
}

function section(root, title, note) {
  root.append(el("h2", {}, title));
  if (note) root.append(el("p", {"class": "note"}, note));
}

function legend(items) {
  return el("div", {"class": "legend"}, items.map(([label, color]) =>
    el("span", {}, [el("span", {"class": "chip", "style": `background:${color}`}), label])));
}

// ---- the key figures --------------------------------------------------------------------
function header(root, data) {
  root.append(el("h1", {}, data.title));
  root.append(el("p", {"class": "head"}, data.head));
  const fits = data.fits.startsWith("does NOT fit") ? "fits-no" : "head";
  root.append(el("p", {"class": fits}, data.fits));
  const t = data.totals;
  const cards = [];
  const card = (label, child) => cards.push(el("div", {"class": "card"},
                                               [el("div", {"class": "label"}, label), child]));
  if (t.step_time !== undefined) {
    card("step time (predicted)", fig("step_time", t.step_time, fmtTime));
    card("compute", fig("compute", t.compute, fmtTime));
    card("communication", fig("communication", t.communication, fmtTime));
    card("bubble", fig("bubble", t.bubble, fmtTime));
  }
  card("model FLOPs per step", fig("flops", t.flops, fmtFlops));
  if (t.per_device !== undefined) card("per device", fig("per_device", t.per_device, fmtRate));
  if (t.mfu !== undefined && t.mfu !== null) card("MFU", fig("mfu", t.mfu, fmtShare));
  if (t.peak_memory !== undefined) {
    card("largest peak", fig("peak_memory", t.peak_memory, fmtBytes));
    if (t.usable_memory) {
      card("of usable memory", fig("usable_memory", t.usable_memory, fmtBytes));
      card("device memory", fig("device_memory", t.device_memory, fmtBytes));
    }
  }
  root.append(el("div", {"class": "cards"}, cards));
  if (t.step_time !== undefined) {
    root.append(el("p", {"class": "note"}, "Step time = compute + communication + bubble of " +
      "the busiest process, as the cost model predicts it; model FLOPs are the forward, " +
      `loss and backward ops' (${t.micro_batches} micro-batch(es), recomputation not ` +
      `counted); MFU against the devices' ${t.dtype} peak.`));
  } else {
    root.append(el("p", {"class": "note"}, "This plan has no estimate: plan it on a " +
      "cluster (or run `distgraph plan --report`) to see its times and memory."));
  }
}

// ---- the cluster ------------------------------------------------------------------------
function cluster(root, data) {
  const c = data.cluster;
  section(root, `Cluster ${c.name ? "'" + c.name + "'" : ""}: ${c.machines.length} machine(s)`,
          "Each device is coloured by the stage whose process runs on it (grey: none); " +
          "lines are links, wider for more bandwidth. Point at a device for its process.");
  const status = el("div", {"class": "status"}, "");
  const drawing = c.links === null ? clusterGrid(c, status) : clusterGraph(c, status);
  root.append(drawing);
  root.append(status);
  const used = new Set();
  for (const m of c.machines) for (const s of m.stages) if (s >= 0) used.add(s);
  const stages = [...used].sort((a, b) => a - b);
  const chips = stages.slice(0, 40).map(s => [`stage ${s}`, stageColor(s)]);
  if (stages.length > 40) chips.push([`... ${stages.length - 40} more stages`, "#fff"]);
  root.append(legend(chips));
  const rows = c.classes.slice().sort((a, b) => b.bandwidth - a.bandwidth).map(k =>
    el("tr", {}, [el("td", {}, k.scope === "inside" ? "inside machines" : "between machines"),
                  el("td", {}, k.type), el("td", {"class": "num"}, sig(k.bandwidth, 4)),
                  el("td", {"class": "num"}, sig(k.latency, 4)),
                  el("td", {"class": "num"}, k.count)]));
  root.append(el("table", {}, [el("tr", {}, ["where", "type", "GB/s", "latency µs",
                                             "links"].map(h => el("th", {}, h))), ...rows]));
}

function deviceInfo(m, k) {
  const p = m.processes[k];
  return `machine ${m.id} (${m.host}), device ${m.devices[k]}: ` +
    (p < 0 ? "no process" : `process ${p}, stage ${m.stages[k]}`);
}

// A grid of machines, each a block of its devices (a cluster of many machines).
function clusterGrid(c, status) {
  const most = Math.max(...c.machines.map(m => m.devices.length), 1);
  const across = Math.ceil(Math.sqrt(most * 2));
  const down = Math.ceil(most / across);
  const cell = Math.max(2, Math.min(12, Math.floor((WIDTH - 20) /
    (Math.ceil(Math.sqrt(c.machines.length * 2)) * (across + 1)))));
  const boxW = across * cell + 3, boxH = down * cell + 3;
  const cols = Math.max(1, Math.floor((WIDTH - 10) / (boxW + 2)));
  const rows = Math.ceil(c.machines.length / cols);
  const height = rows * (boxH + 2) + 10;
  const root = svg("svg", {width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const byColor = {};
  c.machines.forEach((m, i) => {
    const x0 = 5 + (i % cols) * (boxW + 2), y0 = 5 + Math.floor(i / cols) * (boxH + 2);
    root.append(svg("rect", {x: x0, y: y0, width: boxW, height: boxH, fill: "#f3f5f8",
                             stroke: "#b9c0cc", "stroke-width": 0.5}));
    m.stages.forEach((s, k) => {
      const x = x0 + 1.5 + (k % across) * cell, y = y0 + 1.5 + Math.floor(k / across) * cell;
      (byColor[s] = byColor[s] || []).push(`M${x} ${y}h${cell - 0.5}v${cell - 0.5}` +
                                           `h${0.5 - cell}z`);
    });
  });
  // one path per stage: tens of thousands of devices stay a few elements
  for (const [s, parts] of Object.entries(byColor)) {
    root.append(svg("path", {d: parts.join(""), fill: stageColor(Number(s))}));
  }
  root.addEventListener("mousemove", ev => {
    const r = root.getBoundingClientRect();
    const x = ev.clientX - r.left - 5, y = ev.clientY - r.top - 5;
    const i = Math.floor(y / (boxH + 2)) * cols + Math.floor(x / (boxW + 2));
    const m = c.machines[i];
    if (!m) return;
    const dx = x - (i % cols) * (boxW + 2) - 1.5, dy = y - Math.floor(i / cols) * (boxH + 2) - 1.5;
    const k = Math.floor(dy / cell) * across + Math.floor(dx / cell);
    status.textContent = k >= 0 && k < m.devices.length ? deviceInfo(m, k) :
      `machine ${m.id} (${m.host}): devices ${m.devices[0]}-${m.devices[m.devices.length - 1]}`;
  });
  return root;
}

// The resource graph itself: machines with their devices, switches, every link.
function clusterGraph(c, status) {
  const n = c.machines.length;
  const most = Math.max(...c.machines.map(m => m.devices.length), 1);
  const across = Math.min(most, 8);
  const cell = 34;
  const boxW = across * (cell + 6) + 14, boxH = Math.ceil(most / across) * (cell + 6) + 40;
  const cols = Math.max(1, Math.min(n, Math.floor((WIDTH - 20) / (boxW + 24))));
  const switchRow = c.switches.length ? 60 : 0;
  const height = switchRow + Math.ceil(n / cols) * (boxH + 24) + 16;
  const root = svg("svg", {width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const at = {};          // node id -> [x, y]
  // machines under the links under the nodes: a link inside a machine shows on its box
  const frames = svg("g", {}), links = svg("g", {}), boxes = svg("g", {});
  c.switches.forEach((id, k) => {
    at[id] = [(k + 1) * WIDTH / (c.switches.length + 1), 30];
    boxes.append(svg("circle", {cx: at[id][0], cy: 30, r: 10, fill: "#fff", stroke: "#555"}));
    boxes.append(svg("text", {x: at[id][0] + 13, y: 34, "class": "small muted"}, `switch ${id}`));
  });
  c.machines.forEach((m, i) => {
    const x0 = 10 + (i % cols) * (boxW + 24);
    const y0 = switchRow + 10 + Math.floor(i / cols) * (boxH + 24);
    frames.append(svg("rect", {x: x0, y: y0, width: boxW, height: boxH, rx: 6, fill: "#f3f5f8",
                               stroke: "#9aa3b5"}));
    frames.append(svg("text", {x: x0 + 8, y: y0 + 15}, `${m.host} (machine ${m.id})`));
    frames.append(svg("text", {x: x0 + 8, y: y0 + boxH - 6, "class": "small muted"},
                     `${m.models.join(", ")}, ${m.memory.map(g => g + " GB").join(", ")}`));
    m.devices.forEach((id, k) => {
      const x = x0 + 10 + (k % across) * (cell + 6);
      const y = y0 + 22 + Math.floor(k / across) * (cell + 6);
      at[id] = [x + cell / 2, y + cell / 2];
      const rect = svg("rect", {x, y, width: cell, height: cell, rx: 3,
                                fill: stageColor(m.stages[k]), stroke: "#4a5160"});
      rect.addEventListener("mouseenter", () => { status.textContent = deviceInfo(m, k); });
      boxes.append(rect);
      boxes.append(svg("text", {x: x + 3, y: y + 13, "class": "small"}, `d${id}`));
      if (m.processes[k] >= 0) {
        boxes.append(svg("text", {x: x + 3, y: y + 27, "class": "small"}, `p${m.processes[k]}`));
      }
    });
    const nics = Object.entries(c.nics).filter(([, mid]) => mid === m.id);
    nics.forEach(([id], k) => {
      at[id] = [x0 + (k + 1) * boxW / (nics.length + 1), y0];
      boxes.append(svg("rect", {x: at[id][0] - 4, y: y0 - 4, width: 8, height: 8, fill: "#555"}));
    });
  });
  const bws = c.links.map(l => l[2]);
  const lo = Math.log(Math.min(...bws, 1)), hi = Math.log(Math.max(...bws, 1));
  for (const [a, b, bw] of c.links) {
    if (!at[a] || !at[b]) continue;
    const w = 0.6 + 3.4 * (hi > lo ? (Math.log(bw) - lo) / (hi - lo) : 1);
    const [x1, y1] = at[a], [x2, y2] = at[b];
    // devices of one row: an arc under it, deeper for farther pairs, so links stay apart
    const sag = y1 === y2 ? 0.15 * Math.abs(x2 - x1) : 0;
    links.append(svg("path", {d: `M${x1} ${y1}Q${(x1 + x2) / 2} ${(y1 + y2) / 2 + sag} ${x2} ${y2}`,
                              fill: "none", stroke: "#2f5d8a", "stroke-opacity": 0.28,
                              "stroke-width": w}));
  }
  root.append(frames, links, boxes);
  return root;
}

// ---- the schedule -----------------------------------------------------------------------
function axis(root, x0, width, y, end) {
  const ticks = 6;
  for (let k = 0; k <= ticks; k++) {
    const t = end * k / ticks, x = x0 + width * k / ticks;
    root.append(svg("line", {x1: x, x2: x, y1: y, y2: y + 4, stroke: "#777"}));
    root.append(svg("text", {x: k === ticks ? x : x - 10, y: y + 15, "class": "small muted",
                             "text-anchor": k === ticks ? "end" : "start"}, fmtTime(t)));
  }
}

// lanes: [{label, spans: [[start, seconds, kind, chunk, micro-batch, comm]]}]; kindOf maps
// a span to its colour key and whether it is a message (a thinner bar)
function lanesChart(lanes, end, kindOf, extras) {
  const left = 190, width = WIDTH - left - 20, row = 22;
  const height = lanes.length * row + 34;
  const root = svg("svg", {width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const scale = end > 0 ? width / end : 0;
  lanes.forEach((lane, i) => {
    const y = 6 + i * row;
    root.append(svg("rect", {x: left, y, width: scale * end, height: row - 6, fill: "#fbe3e3"}));
    root.append(svg("text", {x: 6, y: y + 12}, lane.label));
    for (const span of lane.spans) {
      const [start, took] = span;
      const [key, message] = kindOf(span);
      const x = left + start * scale, w = Math.max(took * scale, 0.4);
      const h = message ? 5 : row - 6;
      root.append(svg("rect", {x, y: message ? y + row - 11 : y, width: w, height: h,
                               fill: KIND_COLORS[key]}));
      if (span[5] > 0 && !message) {
        root.append(svg("rect", {x: x + w - span[5] * scale, y, width: span[5] * scale,
                                 height: 4, fill: "#1d2330", "fill-opacity": 0.55}));
      }
      if (!message && w > 14 && span[4] >= 0) {
        root.append(svg("text", {x: x + w / 2 - 3, y: y + 12, "class": "small"}, span[4]));
      }
    }
    if (extras) extras(root, lane, y, left, scale, row);
  });
  axis(root, left, width, lanes.length * row + 8, end);
  return root;
}

function predictedSchedule(root, data) {
  const p = data.predicted;
  section(root, "Pipeline schedule (predicted)",
          `Schedule ${p.schedule}, ${p.micro_batches} micro-batch(es): each stage's actions ` +
          "at the seconds the estimate gives their tasks (the slowest process of the stage), " +
          "replayed in the plan's order; the number is the micro-batch, the dark strip the " +
          "action's communication, the pink the stage's idle time (the bubble).");
  const lanes = p.lanes.map(l => ({...l, label: `stage ${l.stage} (${l.processes})`}));
  const letters = "FBIW";
  root.append(lanesChart(lanes, p.makespan, span => [letters[span[2]], false],
    (svgRoot, lane, y, left, scale, row) => {
      if (lane.prologue[1] > 0) {
        svgRoot.append(svg("rect", {x: left + lane.prologue[0] * scale, y,
                                    width: lane.prologue[1] * scale, height: row - 6,
                                    fill: KIND_COLORS.prologue}));
      }
      const [start, took] = lane.update;
      svgRoot.append(svg("rect", {x: left + start * scale, y, width: Math.max(took * scale, 0.4),
                                  height: row - 6, fill: KIND_COLORS.update}));
    }));
  root.append(legend([["forward (F)", KIND_COLORS.F], ["backward / input gradient (B, I)",
    KIND_COLORS.B], ["weight gradient (W)", KIND_COLORS.W], ["update", KIND_COLORS.update],
    ["prologue", KIND_COLORS.prologue], ["communication", "#555"], ["bubble", "#fbe3e3"]]));
  root.append(el("p", {"class": "note"}, ["Predicted step ",
    fig("predicted_step", p.step_time, fmtTime), " (the estimate); the schedule replayed " +
    "at the tasks' seconds ends at ", fig("replayed_step", p.makespan, fmtTime), "."]));
}

function measuredSchedule(root, data) {
  const m = data.measured;
  section(root, `Pipeline schedule (measured, step ${m.step})`,
          "What the run's timeline recorded in its last step, one lane per rank; messages " +
          "are the thin bars under the tasks.");
  const lanes = m.lanes.map(l => ({...l, label: `rank ${l.rank} (process ${l.process}, ` +
                                                `stage ${l.stage})`}));
  const keys = {forward: "F", backward: "B", backward_input: "I", backward_weight: "W",
                update: "update", send: "send", recv: "recv"};
  root.append(lanesChart(lanes, m.makespan, span => {
    const kind = m.kinds[span[2]];
    return [keys[kind], kind === "send" || kind === "recv"];
  }));
  const more = m.hidden ? `; ${m.hidden} more rank(s) not drawn` : "";
  root.append(el("p", {"class": "note"}, ["Measured step ", fig("measured_step", m.makespan,
                                                                fmtTime), more + "."]));
}

// ---- memory and time --------------------------------------------------------------------
function barChart(rows, top, parts, marks) {
  const left = 300, width = WIDTH - left - 190, row = 24;
  const height = rows.length * row + 12;
  const root = svg("svg", {width: WIDTH, height, viewBox: `0 0 ${WIDTH} ${height}`});
  const scale = top > 0 ? width / top : 0;
  rows.forEach((r, i) => {
    const y = 6 + i * row;
    root.append(svg("text", {x: 6, y: y + 13}, r.label));
    let x = left;
    for (const [key, color] of parts) {
      const w = (r[key] || 0) * scale;
      root.append(svg("rect", {x, y, width: Math.max(w, 0), height: row - 8, fill: color}));
      x += w;
    }
    for (const [key, color, dash] of marks) {
      if (!r[key] || r[key] > top) continue;         // off the scale: the text says it
      const xm = left + r[key] * scale;
      root.append(svg("line", {x1: xm, x2: xm, y1: y - 2, y2: y + row - 6, stroke: color,
                               "stroke-width": 2, "stroke-dasharray": dash}));
    }
    root.append(svg("text", {x: left + width + 8, y: y + 13}, r.text));
  });
  return root;
}

function memory(root, data) {
  const mem = data.memory;
  section(root, "Memory per group of alike processes",
          "The estimate's peak of each group: parameters, optimizer states, gradients, " +
          "activations and the running kernel's workspace; the dashed line is what a device may hold, its usable memory (its " +
          "memory less its reserve, at most the strategy's memory budget), the solid one " +
          "its memory (left out where it is over three times the largest peak: the text " +
          "gives it).");
  // the bars' scale: the largest peak, and the devices' lines where they are near it
  const peaks = Math.max(...mem.groups.map(g => g.peak), 1);
  const near = mem.groups.flatMap(g => [g.memory, g.usable]).filter(v => v <= 3 * peaks);
  const top = Math.max(peaks, ...near) * 1.02;
  const rows = mem.groups.map(g => ({...g, label: `stage ${g.stage}: ${g.processes}` +
    (g.count > 1 ? ` (${g.count})` : ""), text: `${fmtBytes(g.peak)}` +
    (g.usable ? ` of ${fmtBytes(g.usable)} usable (${(100 * g.peak / g.usable).toFixed(1)}%)` :
     "")}));
  root.append(barChart(rows, top, MEMORY_PARTS, [["usable", "#b3261e", "4 3"],
                                                 ["memory", "#1d2330", ""]]));
  root.append(legend(MEMORY_PARTS.concat([["usable", "#b3261e"], ["device memory", "#1d2330"]])));
  const cells = ["processes", ...MEMORY_PARTS.map(p => p[0]), "peak", "usable", "memory"];
  const body = mem.groups.map((g, i) => el("tr", {}, [el("td", {}, `stage ${g.stage}: ` +
    g.processes), ...["parameters", "states", "gradients", "activations", "workspace", "peak",
    "usable", "memory"].map(k => el("td", {"class": "num"}, fig(`memory:${i}:${k}`, g[k], fmtBytes)))]));
  root.append(el("table", {}, [el("tr", {}, cells.map(h => el("th", {}, h))), ...body]));
  if (mem.hidden) {
    root.append(el("p", {"class": "note"}, `${mem.hidden} more group(s) with smaller ` +
                   "peaks are not drawn (explain(full=True) has each)."));
  }
}

function stepTime(root, data) {
  const stages = data.stages.filter(s => s.compute !== undefined);
  if (!stages.length) return;
  section(root, "Step time per stage",
          "Each stage's busiest process: compute, communication and the rest of the " +
          "predicted step (the bubble), with the stage's model FLOP/s per device and MFU.");
  const rows = stages.map(s => ({...s, label: `stage ${s.index} (process ${s.process})`,
    text: s.per_device === undefined ? "" : `${fmtRate(s.per_device)}` +
      (s.mfu === null || s.mfu === undefined ? "" : `, MFU ${fmtShare(s.mfu)}`)}));
  root.append(barChart(rows, data.totals.step_time, STEP_PARTS, []));
  root.append(legend(STEP_PARTS));
  const body = stages.map(s => el("tr", {}, [el("td", {}, `stage ${s.index}`),
    ...["compute", "communication", "bubble"].map(k =>
      el("td", {"class": "num"}, fig(`stage:${s.index}:${k}`, s[k], fmtTime))),
    el("td", {"class": "num"}, s.per_device === undefined ? "" :
       fig(`stage:${s.index}:per_device`, s.per_device, fmtRate)),
    el("td", {"class": "num"}, s.mfu === null || s.mfu === undefined ? "" :
       fig(`stage:${s.index}:mfu`, s.mfu, fmtShare))]));
  root.append(el("table", {}, [el("tr", {}, ["stage", "compute", "communication", "bubble",
    "per device", "MFU"].map(h => el("th", {}, h))), ...body]));
}

// ---- words ------------------------------------------------------------------------------
function stagesTable(root, data) {
  section(root, "Stages", "Where each stage runs, its layout and the layers it holds.");
  const body = data.stages.map(s => el("tr", {}, [el("td", {}, `${s.index}`),
    el("td", {}, `[${s.mesh.join(", ")}] (${s.dims.join(", ")})`), el("td", {}, s.where),
    el("td", {}, s.layout.join("; ")), el("td", {}, s.holds),
    el("td", {"class": "num"}, fig(`stage:${s.index}:flops`, s.flops, fmtFlops))]));
  root.append(el("table", {}, [el("tr", {}, ["stage", "mesh", "processes and devices",
    "layout", "holds", "model FLOPs"].map(h => el("th", {}, h))), ...body]));
}

function savers(root, data) {
  section(root, "Memory savers", data.savers.length ? "What the search chose for the " +
          "savers the strategy left to it, and every alternative it priced." :
          "The strategy left no memory saver to the search.");
  for (const c of data.savers) {
    const rows = [[c.value, c.peak, c.seconds, true], ...c.others.map(o =>
      [o.value, o.peak, o.seconds, false])];
    const body = rows.map(([value, peak, seconds, chosen], j) => el("tr",
      {"class": chosen ? "chosen" : ""}, [el("td", {}, JSON.stringify(value)),
      el("td", {"class": "num"}, peak === null ? "" :
         fig(`saver:${c.option}:${j}:peak`, peak, fmtBytes)),
      el("td", {"class": "num"}, seconds === null ? "does not fit" :
         fig(`saver:${c.option}:${j}:seconds`, seconds, fmtTime)),
      el("td", {}, chosen ? "chosen" : "")]));
    root.append(el("p", {}, c.head));
    for (const note of c.notes) root.append(el("p", {"class": "note"}, note));
    root.append(el("table", {}, [el("tr", {}, [c.option, "peak", "step", ""].map(h =>
      el("th", {}, h))), ...body]));
  }
}

function strategy(root, data) {
  section(root, "Strategy", "Bold: set otherwise than the default.");
  const body = data.strategy.map(([name, value, changed]) => el("tr",
    {"class": changed ? "changed" : ""}, [el("td", {}, name), el("td", {},
    JSON.stringify(value))]));
  root.append(el("table", {}, [el("tr", {}, [el("th", {}, "field"), el("th", {}, "value")]),
                               ...body]));
}

function texts(root, data) {
  if (data.describe) {
    section(root, "The cluster it was planned for");
    root.append(el("pre", {}, data.describe));
  }
  if (data.search) {
    section(root, "The search");
    root.append(el("pre", {}, data.search));
  }
  root.append(el("footer", {}, `distgraph ${data.version}`));
}

// ---- the page ---------------------------------------------------------------------------
function draw() {
  const started = performance.now();
  const data = JSON.parse(document.getElementById("plan-data").textContent);
  const root = document.getElementById("report");
  header(root, data);
  if (data.cluster) cluster(root, data);
  if (data.predicted) predictedSchedule(root, data);
  if (data.measured) measuredSchedule(root, data);
  if (data.memory.groups.length) memory(root, data);
  stepTime(root, data);
  stagesTable(root, data);
  savers(root, data);
  strategy(root, data);
  texts(root, data);
  const now = performance.now();
  document.body.setAttribute("data-rendered", "1");
  document.body.setAttribute("data-render-ms", (now - started).toFixed(1));
  document.body.setAttribute("data-ready-ms", now.toFixed(1));   // since navigation began
}

draw();
