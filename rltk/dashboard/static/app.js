// rltk dashboard: the config builder (a form generated from /api/form) and the run viewer.
// Plain JS, no build step. Every text that comes from a config, a registry docstring or a run folder is put
// into the page with textContent, never parsed as HTML: a trajectory is model output.
"use strict";

const TOKEN = document.querySelector('meta[name="rltk-token"]').content;
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

async function getJSON(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function postJSON(url, payload) {
  const response = await fetch(url, {
    method: "POST", headers: {"Content-Type": "application/json", "X-Rltk-Token": TOKEN},
    body: JSON.stringify(payload),
  });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// ------------------------------------------------------------------ tabs
function showPage(page) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.page === page);
  for (const p of document.querySelectorAll(".page")) p.classList.toggle("hidden", p.id !== page);
  clearInterval(viewer.listTimer);
  if (page === "page-runs") {  // live: a run started after the page was opened appears in the list
    loadRuns().catch(showRunsError);
    viewer.listTimer = setInterval(() => loadRuns().catch(showRunsError), 3000);
  }
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    const hash = tab.dataset.page === "page-runs" ? (viewer.run ? "#runs/" + encodeURIComponent(viewer.run) : "#runs") : "#build";
    if (location.hash !== hash) history.replaceState(null, "", hash);
    showPage(tab.dataset.page);
  });
}

// ------------------------------------------------------------------ config builder
const state = {form: null, overrides: new Map(), values: {}, result: null, pending: null, seq: 0,
               open: new Set(),  // sections the user unfolded stay unfolded when the form is drawn again
               unset: new Map()};  // key -> the value it had before the user's override (what removing it gives)

// A value as one would type it after key= on the command line (OmegaConf's dotlist grammar reads YAML):
// lists and mappings in YAML's flow style, [{name: rl, type: rl, overrides: {}}], not JSON's quotes.
function valueText(v) {
  if (v === null || v === undefined) return "null";
  if (typeof v === "string") return v;
  return flowText(v);
}

function flowText(v) {
  if (v === null || v === undefined) return "null";
  if (Array.isArray(v)) return "[" + v.map(flowText).join(", ") + "]";
  if (typeof v === "object") return "{" + Object.entries(v).map(([k, x]) => `${k}: ${flowText(x)}`).join(", ") + "}";
  if (typeof v === "string") {  // quoted only where YAML would read it as something else
    const plain = /^[A-Za-z_/.][\w./\-]*$/.test(v) && !/^(true|false|null|yes|no|on|off|~)$/i.test(v);
    return plain ? v : JSON.stringify(v);
  }
  return String(v);
}

// Whether the text typed for a key gives the value it already has without the override.
function sameValue(text, v) {
  const t = String(text).trim();
  if (v === undefined) return false;
  if (v === null) return t === "null" || t === "~";
  if (typeof v === "boolean") return t.toLowerCase() === String(v);
  if (typeof v === "number") return t !== "" && !isNaN(Number(t)) && Number(t) === v;
  if (typeof v === "string") return t === v || t === JSON.stringify(v);
  const squeeze = (x) => x.replace(/\s+/g, "");
  return squeeze(t) === squeeze(valueText(v)) || squeeze(t) === JSON.stringify(v);
}

// Set key=text; a value equal to what the key has without an override removes the override instead
// (``fallback``: that value when the config does not hold the key, e.g. an argument's signature default).
function setOverride(key, text, fallback) {
  if (!state.overrides.has(key)) state.unset.set(key, key in state.values ? state.values[key] : fallback);
  if (sameValue(text, state.unset.get(key))) dropOverride(key);
  else { state.overrides.set(key, text); scheduleBuild(); }
}

function dropOverride(key) {
  state.overrides.delete(key);
  state.unset.delete(key);
  scheduleBuild();
}

function clearOverrides() {
  state.overrides.clear();
  state.unset.clear();
  scheduleBuild();
}

function dropArgs(prefix) {  // a swapped component does not take the old one's arguments
  for (const k of [...state.overrides.keys()]) if (k.startsWith(prefix)) { state.overrides.delete(k); state.unset.delete(k); }
}

function overridesList() {
  return [...state.overrides.entries()].map(([k, v]) => `${k}=${v}`);
}

function scheduleBuild() {
  clearTimeout(state.pending);
  state.pending = setTimeout(runBuild, 250);
}

async function runBuild() {
  const seq = ++state.seq;
  $("#busy").textContent = "validating...";
  const result = await postJSON("/api/build", {recipe: $("#recipe").value, overrides: overridesList()});
  if (seq !== state.seq) return;  // a newer edit is on its way
  $("#busy").textContent = "";
  state.result = result;
  if (Object.keys(result.values).length) state.values = result.values;
  renderForm();
  renderResult();
}

function renderResult() {
  const r = state.result;
  const status = $("#status");
  status.className = "status " + (r.ok ? "ok" : "bad");
  status.textContent = r.ok ? r.message : (r.error ? r.error.message : "not valid");
  status.dataset.ok = r.ok ? "true" : "false";
  const warnings = $("#warnings");
  warnings.replaceChildren(...r.warnings.map((w) => el("li", {class: "muted", text: "warning: " + w})));
  $("#command").textContent = r.command;
  $("#yaml").textContent = r.yaml;
  $("#overrides").replaceChildren(...[...state.overrides.entries()].map(([k, v]) =>
    el("li", {}, el("code", {text: `${k}=${v}`}), " ",
       el("button", {class: "small", title: "remove", onclick: () => dropOverride(k), text: "x"}))));
}

// The field an error belongs to: its key, or the component whose arguments it names.
function errorField(r) {
  if (!r || r.ok || !r.error || !r.error.key) return null;
  const key = r.error.key;
  return key.endsWith("_args") ? key.slice(0, -5) : key;
}

function fieldsByKey() {
  const out = new Map();
  (function walk(section) {
    for (const f of section.fields) out.set(f.key, f);
    for (const s of section.sections) walk(s);
  })(state.form.schema);
  return out;
}

function renderForm() {
  const form = $("#form");
  const focusedKey = document.activeElement && document.activeElement.dataset
    ? document.activeElement.dataset.key : null;
  const expert = $("#view-expert").checked;
  const fields = fieldsByKey();
  const errorAt = errorField(state.result);
  let errorShown = false;
  const renderField = (f) => {
    const node = fieldNode(f, errorAt === f.key ? state.result.error.message : null);
    if (errorAt === f.key) errorShown = true;
    return node;
  };
  let content;
  if (!expert) {
    content = [el("p", {class: "muted", text: "The keys a new run needs. The expert view shows every key of the " +
      "schema and every registered component."}),
      ...state.form.beginner.filter((k) => fields.has(k)).map((k) => renderField(fields.get(k)))];
  } else {
    content = [sectionNode(state.form.schema, renderField, true)];
  }
  if (errorAt && !errorShown && fields.has(errorAt)) {  // the beginner view hides that key: show it anyway
    content.unshift(renderField(fields.get(errorAt)));
  }
  form.replaceChildren(...content);
  if (focusedKey) {
    const again = form.querySelector(`[data-key="${CSS.escape(focusedKey)}"]`);
    if (again) { again.focus(); if (again.setSelectionRange && again.value) again.setSelectionRange(again.value.length, again.value.length); }
  }
}

// A component's ``*_args`` mapping is filled by the argument form under the component: no free-text box for it.
function filledByForm(f, fields) {
  if (!f.key.endsWith("_args")) return false;
  const owner = fields.get(f.key.slice(0, -5));
  return Boolean(owner && owner.component && owner.component !== "algorithm");
}

function sectionNode(section, renderField, top) {
  const errorAt = errorField(state.result);
  const fields = fieldsByKey();
  const open = state.open.has(section.key) || section.fields.some((f) => state.overrides.has(f.key) || f.key === errorAt);
  const body = [
    section.doc ? el("div", {class: "section-doc", text: section.doc}) : null,
    ...section.fields.filter((f) => !filledByForm(f, fields)).map(renderField),
    ...section.sections.map((s) => sectionNode(s, renderField, false)),
  ];
  if (top) {
    // the top level: its own keys, then each section folded
    return el("div", {}, ...body);
  }
  const node = el("details", {class: "section", open: open || undefined, "data-section": section.key},
                  el("summary", {text: section.title}), ...body);
  node.addEventListener("toggle", () => { if (node.open) state.open.add(section.key); else state.open.delete(section.key); });
  return node;
}

// The box of one key. ``argDefault`` (an argument's {required, default}) marks a component argument, which
// the config may leave unset: its select then starts with "default X" (choosing it removes the override)
// instead of showing the first value as if it were chosen.
function inputFor(key, widget, current, choices, nullable, argDefault) {
  // what the user typed stays in the box (even when it does not validate); otherwise the config's value
  const text = state.overrides.has(key) ? state.overrides.get(key) : (current === undefined ? "" : valueText(current));
  const fallback = argDefault && !argDefault.required ? argDefault.default : undefined;
  const placeholder = argDefault ? (argDefault.required ? "required" : "default " + valueText(argDefault.default)) : "";
  const options = choices || (widget === "bool" ? ["true", "false"] : null);
  if (options) {
    const opts = [...options, ...(nullable && !options.includes("null") ? ["null"] : [])];
    const unset = argDefault ? [el("option", {value: "", text: placeholder, selected: text === "" || undefined})] : [];
    const select = el("select", {"data-key": key, "aria-label": key}, ...unset,
      ...opts.map((o) => el("option", {value: o, text: o, selected: o === text || undefined})));
    select.addEventListener("change", () => {
      if (select.value === "") dropOverride(key); else setOverride(key, select.value, fallback);
    });
    return select;
  }
  const input = el("input", {type: "text", "data-key": key, "aria-label": key, value: text, placeholder});
  input.addEventListener("input", () => {
    if (input.value === "" && argDefault) dropOverride(key);
    else setOverride(key, input.value, fallback);
  });
  return input;
}

// A preset's settings as leaves (``algorithm.policy_loss_args.clip_eps_high``), as the config's values are.
function leaves(key, v, out = []) {
  if (v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length) {
    for (const [k, x] of Object.entries(v)) leaves(`${key}.${k}`, x, out);
  } else out.push([key, v]);
  return out;
}

// What wins for one setting of a preset: the preset, the recipe's config file, or the user's override.
function presetRow(key, v) {
  const now = state.values[key];
  let wins, note;
  if (now === undefined) { wins = "dropped"; note = "not used: another component was chosen"; }
  else if (JSON.stringify(now) === JSON.stringify(v)) { wins = "preset"; note = "applies"; }
  else {
    wins = state.overrides.has(key) ? "override" : "file";
    note = `overridden by ${wins === "override" ? "your override" : "the recipe's config file"}: ${valueText(now)}`;
  }
  return el("tr", {class: wins === "preset" ? "" : "overridden", "data-key": key, "data-wins": wins},
    el("td", {text: key}), el("td", {text: valueText(v)}), el("td", {class: "wins", text: note}));
}

function fieldNode(f, error) {
  const current = state.values[f.key];
  const meta = el("div", {class: "meta", text: `${f.type}; default ${valueText(f.default)}`});
  let control;
  const extra = [];
  if (f.component === "algorithm") {
    const names = Object.keys(state.form.presets);
    control = el("select", {"data-key": f.key, "aria-label": f.key},
      ...names.map((n) => el("option", {value: n, text: n, selected: n === current || undefined})));
    control.addEventListener("change", () => setOverride(f.key, control.value));
    const preset = state.form.presets[current];
    if (preset) {
      extra.push(el("div", {class: "summary", text: preset.description + " (" + preset.plugin + ")"}));
      extra.push(el("table", {class: "preset-sets", "data-preset": current},
        el("caption", {class: "muted", text: `what '${current}' sets, and what wins (the config file and overrides ` +
                                             "win over a preset)"}),
        ...Object.entries(preset.sets).flatMap(([k, v]) => leaves(k, v)).map(([k, v]) => presetRow(k, v))));
    }
  } else if (f.component && f.multiple) {
    const chosen = Array.isArray(current) ? current : (current ? [current] : []);
    const options = state.form.components[f.component] || [];
    control = el("div", {class: "checks", "data-key": f.key},
      ...options.map((c) => {
        const box = el("input", {type: "checkbox", value: c.name, "data-key": `${f.key}:${c.name}`,
                                 checked: chosen.includes(c.name) || undefined});
        box.addEventListener("change", () => {
          const now = [...control.querySelectorAll("input:checked")].map((b) => b.value);
          if (!box.checked) dropArgs(`${f.key}_args.${c.name}.`);
          setOverride(f.key, "[" + now.join(",") + "]");
        });
        return el("label", {title: c.summary}, box, " " + c.name);
      }));
    for (const name of chosen) {
      const c = options.find((o) => o.name === name);
      if (c) extra.push(argsNode(`${f.key}_args.${name}`, c));
    }
  } else if (f.component) {
    const options = state.form.components[f.component] || [];
    control = el("select", {"data-key": f.key, "aria-label": f.key},
      ...options.map((c) => el("option", {value: c.name, text: `${c.name}  (${c.plugin})`,
                                          selected: c.name === current || undefined})));
    control.addEventListener("change", () => { dropArgs(`${f.key}_args.`); setOverride(f.key, control.value); });
    const c = options.find((o) => o.name === current);
    if (c) {
      extra.push(el("div", {class: "summary", text: c.summary}));
      extra.push(argsNode(`${f.key}_args`, c));
    }
  } else {
    control = inputFor(f.key, f.widget, current, f.choices, f.nullable);
  }
  const node = el("div", {class: "field" + (state.overrides.has(f.key) ? " set" : ""), "data-field": f.key},
    el("label", {class: "key", text: f.key}), control, meta,
    el("div", {class: "doc", text: f.doc || ""}), ...extra);
  if (error && node.querySelector(".component-args [data-error-for]")) error = null;  // shown beside its argument
  if (error) node.append(el("div", {class: "field-error", "data-error-for": f.key, text: error}));
  return node;
}

function argsNode(prefix, component) {
  if (!component.args.length) {
    return el("div", {class: "component-args muted", "data-args-for": prefix, text: `${component.name} takes no arguments`});
  }
  return el("div", {class: "component-args", "data-args-for": prefix},
    el("div", {class: "muted", text: `arguments of ${component.name} (${prefix}.*), from its signature`}),
    ...component.args.map((a) => {
      const key = `${prefix}.${a.name}`;
      const current = state.values[key];
      const r = state.result;
      const error = r && !r.ok && r.error && r.error.message.startsWith(`'${key}'`) ? r.error.message : null;
      return el("div", {class: "arg"}, el("span", {text: a.name + (a.type ? ": " + a.type : "")}),
                inputFor(key, a.widget, current, null, a.widget !== "bool" || a.default === null, a),
                error ? el("div", {class: "field-error", "data-error-for": key, text: error}) : null);
    }));
}

$("#smoothing").addEventListener("input", drawCharts);
$("#log-scale").addEventListener("change", drawCharts);
$("#metric-filter").addEventListener("input", fillMetrics);
$("#extra-metric").addEventListener("change", drawExtra);

async function startBuilder() {
  state.form = await getJSON("/api/form");
  const recipe = $("#recipe");
  recipe.replaceChildren(...state.form.recipes.map((r) => el("option", {value: r, text: r, selected: r === "grpo" || undefined})));
  recipe.addEventListener("change", clearOverrides);
  for (const radio of document.querySelectorAll('input[name="view"]')) radio.addEventListener("change", renderForm);
  $("#clear").addEventListener("click", clearOverrides);
  $("#save").addEventListener("click", async () => {
    const out = $("#save-result");
    try {
      const r = await postJSON("/api/save", {recipe: recipe.value, overrides: overridesList(), name: $("#save-name").value});
      out.className = r.ok ? "status ok" : "status bad";
      out.textContent = r.ok ? `saved ${r.path}\nrun it with: ${r.run_command}` : "not saved: " + r.error.message;
      out.dataset.path = r.ok ? r.path : "";
    } catch (e) {
      out.className = "status bad"; out.textContent = "not saved: " + e.message;
    }
  });
  await runBuild();
}

// ------------------------------------------------------------------ run viewer
const viewer = {run: null, overview: null, step: null, timer: null, listTimer: null, rowsSeen: -1};
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"];

function showRunsError(e) {
  $("#runs-root").textContent = "could not list the runs: " + e.message;
}

async function loadRuns() {
  const data = await getJSON("/api/runs");
  $("#runs-root").textContent = "runs in " + data.root;
  $("#runs-list").replaceChildren(...data.runs.map((r) => el("li", {},
    el("button", {"data-run": r.name, class: r.name === viewer.run ? "active" : "",
                  onclick: () => openRun(r.name), text: r.name + (r.finished ? "" : "  (running?)")}))));
  if (!data.runs.length) $("#runs-list").append(el("li", {class: "muted", text: "no run folders with metrics.jsonl yet"}));
}

async function openRun(name) {
  clearInterval(viewer.timer);
  viewer.run = name; viewer.step = null; viewer.rowsSeen = -1; viewer.overview = null;
  const hash = "#runs/" + encodeURIComponent(name);
  if (location.hash !== hash) history.replaceState(null, "", hash);
  for (const b of document.querySelectorAll("#runs-list button")) b.classList.toggle("active", b.dataset.run === name);
  for (const id of ["#traces", "#curves", "#extra-curve", "#steps"]) $(id).replaceChildren();
  $("#traces-title").textContent = ""; $("#run-summary").textContent = ""; $("#run-title").textContent = name;
  $("#run").classList.remove("missing");
  // a link to a run that is not there (a typo, a deleted folder) says so, without asking for it
  const listed = await getJSON("/api/runs").then((d) => d.runs.some((r) => r.name === name), () => true);
  if (name !== viewer.run) return;
  if (!listed) return runMissing(name, "it is not among the run folders listed on the left");
  if (!await refreshRun()) return;
  viewer.timer = setInterval(refreshRun, 3000);  // live: a running run's new steps appear
}

function runMissing(name, why) {
  clearInterval(viewer.timer);
  $("#run").classList.add("missing");
  $("#run-title").textContent = `no run named '${name}'`;
  $("#run-summary").textContent = `${why}. Choose a run from the list.`;
}

// Redraw the open run when it changed; false (and the page says why) when it cannot be read.
async function refreshRun() {
  if (!viewer.run) return false;
  const name = viewer.run;
  let o;
  try {
    o = await getJSON("/api/runs/" + encodeURIComponent(name));
  } catch (e) {
    if (name === viewer.run) runMissing(name, e.message);
    return false;
  }
  if (name !== viewer.run) return false;  // another run was opened meanwhile
  if (o.rows.length === viewer.rowsSeen && viewer.overview && viewer.overview.finished === o.finished) return true;
  viewer.overview = o; viewer.rowsSeen = o.rows.length;
  $("#run-title").textContent = o.name;
  const final = o.summary && o.summary.final ? Object.entries(o.summary.final).map(([k, v]) => `${k}=${Number(v).toFixed(3)}`).join("  ") : "";
  $("#run-summary").textContent = (o.finished ? "finished. " + final : `running or stopped: ${o.rows.length} metric rows so far`);
  drawCharts();
  fillMetrics();
  renderSteps();
  return true;
}

function drawCharts() {
  const o = viewer.overview;
  if (!o) return;
  $("#curves").replaceChildren(...o.panels.map((p) => chart(p.title, p.ylabel, p.curves)));
  drawExtra();
}

// The metrics to plot, narrowed by the filter box (a part of the name: "eval/", "kl").
function fillMetrics() {
  const o = viewer.overview;
  if (!o) return;
  const extra = $("#extra-metric");
  const chosen = extra.value;
  const filter = $("#metric-filter").value.trim().toLowerCase();
  const keys = o.keys.filter((k) => !filter || k.toLowerCase().includes(filter));
  extra.replaceChildren(el("option", {value: "", text: `- (${keys.length} of ${o.keys.length})`}),
    ...keys.map((k) => el("option", {value: k, text: k, selected: k === chosen || undefined})));
  if (keys.length === 1 && filter) extra.value = keys[0];  // one match: plot it
  drawExtra();
}

// Exponential moving average, as TensorBoard's smoothing slider (0: the raw values), debiased at the start.
function smooth(values, weight) {
  if (!weight) return values;
  let last = 0, n = 0;
  return values.map((v) => { n += 1; last = last * weight + (1 - weight) * v; return last / (1 - weight ** n); });
}

function drawExtra() {
  const key = $("#extra-metric").value;
  const o = viewer.overview;
  if (!key || !o) { $("#extra-curve").replaceChildren(); return; }
  const rows = o.rows.filter((r) => typeof r[key] === "number");
  $("#extra-curve").replaceChildren(chart(key, key, [{label: key, steps: rows.map((r) => r.step), values: rows.map((r) => r[key])}]));
}

// An SVG line chart; hovering shows the nearest point, clicking a step with traces opens them.
function chart(title, ylabel, rawCurves) {
  const W = 720, H = 200, L = 50, R = 10, T = 10, B = 28;
  const weight = Number($("#smoothing").value), logScale = $("#log-scale").checked;
  // log scale: only positive values can be drawn; smoothing applies to what is drawn
  const curves = rawCurves.map((c) => {
    const keep = c.values.map((v) => !logScale || v > 0);
    const steps = c.steps.filter((_, j) => keep[j]), values = c.values.filter((_, j) => keep[j]);
    return {...c, steps, values: smooth(logScale ? values.map(Math.log10) : values, weight), raw: values};
  });
  const xs = curves.flatMap((c) => c.steps), ys = curves.flatMap((c) => c.values);
  const panel = el("div", {class: "panel", "data-panel": title}, el("h4", {text: title}));
  if (!xs.length) return panel;
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("width", "100%");
  const add = (tag, attrs, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n); return n;
  };
  add("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"});
  add("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"});
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    add("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end"}, logScale ? Number((10 ** y).toPrecision(2)) : Number(y.toPrecision(3)));
  }
  const every = Math.max(1, Math.ceil((x1 - x0) / 6));  // steps are whole numbers: whole, distinct ticks
  for (let x = Math.ceil(x0 / every) * every; x <= x1; x += every) {
    add("text", {x: sx(x), y: H - B + 14, "text-anchor": "middle"}, x);
  }
  add("text", {x: W - R, y: H - 2, "text-anchor": "end"}, "step");
  curves.forEach((c, i) => {
    const points = c.steps.map((s, j) => `${sx(s).toFixed(1)},${sy(c.values[j]).toFixed(1)}`).join(" ");
    add("polyline", {points, class: "curve" + (c.faint ? " faint" : ""), stroke: COLORS[i % COLORS.length],
                     "data-label": c.label, "data-values": c.values.map((v) => Number(v.toPrecision(4))).join(" ")});
    add("text", {x: W - R - 4, y: T + 12 + 13 * i, "text-anchor": "end", fill: COLORS[i % COLORS.length]}, c.label);
  });
  const marker = add("circle", {r: 4, fill: "none", stroke: "#000", visibility: "hidden"});
  const tooltip = $("#tooltip");
  const nearest = (evt) => {
    const box = svg.getBoundingClientRect();
    const x = x0 + ((evt.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
    let best = null;
    for (const c of curves) c.steps.forEach((s, j) => {
      const d = Math.abs(s - x);
      if (!best || d < best.d) best = {d, step: s, value: c.values[j], raw: c.raw[j], label: c.label};
    });
    return best;
  };
  svg.addEventListener("mousemove", (evt) => {
    const p = nearest(evt);
    if (!p) return;
    marker.setAttribute("cx", sx(p.step)); marker.setAttribute("cy", sy(p.value)); marker.setAttribute("visibility", "visible");
    tooltip.textContent = `step ${p.step}: ${p.label} ${Number(p.raw).toPrecision(4)}`;
    tooltip.style.left = evt.clientX + 12 + "px"; tooltip.style.top = evt.clientY + 12 + "px";
    tooltip.classList.remove("hidden");
  });
  svg.addEventListener("mouseleave", () => { tooltip.classList.add("hidden"); marker.setAttribute("visibility", "hidden"); });
  svg.addEventListener("click", (evt) => {
    const p = nearest(evt);
    if (p && viewer.overview && viewer.overview.trace_steps[p.step]) openStep(p.step);
  });
  panel.append(svg);
  return panel;
}

// One row per step: the rows a step logs apart (a warm-up's, an evaluation's) merged, in step order.
function rowsByStep(rows) {
  const merged = new Map();
  for (const r of rows) merged.set(r.step, Object.assign(merged.get(r.step) || {}, r));
  return [...merged.values()].sort((a, b) => a.step - b.step);
}

// One format for a whole column, so its numbers line up: whole numbers as such; otherwise a fixed number of
// decimals giving its largest value 4 significant digits; scientific notation when that would not fit.
function columnFormat(values) {
  const nums = values.filter((v) => typeof v === "number" && Number.isFinite(v));
  if (nums.every(Number.isInteger)) return (v) => String(v);
  const top = Math.max(...nums.map(Math.abs));
  if (top >= 1e5 || top < 1e-3) return (v) => v.toExponential(3);
  const decimals = Math.min(6, Math.max(0, 3 - Math.floor(Math.log10(top))));
  return (v) => v.toFixed(decimals);
}

function renderSteps() {
  const o = viewer.overview;
  const keys = o.table_keys;
  const table = $("#steps");
  const steps = rowsByStep(o.rows);
  const formats = Object.fromEntries(keys.map((k) => [k, columnFormat(steps.map((r) => r[k]))]));
  const head = el("tr", {}, el("th", {text: "step"}), ...keys.map((k) => el("th", {text: k})), el("th", {text: "traces"}));
  const rows = steps.map((r) => {
    const traced = o.trace_steps[r.step];
    const tr = el("tr", {"data-step": r.step, class: (traced ? "has-traces" : "") + (r.step === viewer.step ? " selected" : "")},
      el("td", {text: r.step}),
      ...keys.map((k) => el("td", {text: typeof r[k] === "number" ? (Number.isFinite(r[k]) ? formats[k](r[k]) : String(r[k])) : ""})),
      el("td", {text: traced ? `${traced}` : ""}));
    if (traced) tr.addEventListener("click", () => openStep(r.step));
    return tr;
  });
  table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
}

async function openStep(step) {
  viewer.step = step;
  renderSteps();
  const data = await getJSON(`/api/runs/${encodeURIComponent(viewer.run)}/traces?step=${step}`);
  $("#traces-title").textContent = `step ${step}: ${data.traces.length} sampled trajectories`;
  $("#traces").replaceChildren(...data.traces.map(trajectoryNode));
}

// Numbers to 4 significant digits without trailing zeros (0.5, 0.7071, 3), as Python's format(v, ".4g").
function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)));
}

function trajectoryNode(t, index) {
  const sign = t.advantage > 0 ? "positive" : (t.advantage < 0 ? "negative" : "");
  const head = el("div", {class: "head"},
    el("span", {text: `#${index} group ${t.group_id} sample ${fmt(t.sample_index)}`}),
    el("span", {text: `score ${fmt(t.score)}`, "data-score": t.score}),
    el("span", {class: sign, text: `advantage ${fmt(t.advantage)}`}),
    el("span", {text: `finish ${fmt(t.finish_reason)}`}),
    el("span", {text: `source ${fmt(t.source)}, staleness ${fmt(t.staleness)}`}),
    el("span", {text: `${t.policy_tokens}/${t.response_tokens} policy tokens`}));
  const rewards = el("table", {class: "rewards"}, ...Object.entries(t.rewards || {}).map(([k, v]) =>
    el("tr", {}, el("td", {text: k}), el("td", {text: fmt(v)}))));
  const node = el("div", {class: "trajectory", "data-row": t.row}, head,
    el("div", {class: "muted", text: "prompt"}), el("pre", {class: "prompt", text: t.prompt}),
    el("div", {class: "muted", text: `response (ground truth: ${t.ground_truth})`}), el("pre", {class: "response", text: t.response}),
    el("div", {class: "muted", text: "reward per reward function"}), rewards,
    el("div", {class: "muted", text: "tokens: each turn; grey = not the policy's (response_mask 0); colour = advantage; hover for details"}),
    tokensNode(t));
  const info = t.info || {};
  if (Array.isArray(info.messages)) {
    node.append(el("div", {class: "muted", text: "transcript (assistant turns, tool calls, observations)"}),
      el("div", {class: "messages"}, ...info.messages.map(messageNode)));
  }
  const rest = Object.fromEntries(Object.entries(info).filter(([k]) => k !== "messages"));
  if (Object.keys(rest).length) {
    node.append(el("details", {}, el("summary", {text: "workflow info"}), el("pre", {text: JSON.stringify(rest, null, 1)})));
  }
  return node;
}

function messageNode(m) {
  const parts = [`${m.role}: `, typeof m.content === "string" ? m.content : JSON.stringify(m.content)];
  if (m.tool_calls) parts.push("\ntool calls: " + JSON.stringify(m.tool_calls));
  return el("div", {class: "msg " + (m.role || ""), text: parts.join("")});
}

function tokensNode(t) {
  const box = el("div", {class: "tokens"});
  const adv = t.advantages || [];
  const scale = Math.max(1e-6, ...adv.filter((a) => a !== null).map(Math.abs));
  let turn = 0, previous = null;
  t.tokens.forEach((text, i) => {
    const mask = t.response_mask[i];
    if (mask !== previous) {
      box.append(el("span", {class: "turn-label", text: mask ? `[assistant turn ${++turn}]` : "[observation]"}));
      previous = mask;
    }
    const a = adv[i];
    const span = el("span", {class: "tok" + (mask ? " policy" : " obs"), "data-mask": mask, text: text});
    if (mask && a !== null && a !== undefined) {
      const alpha = Math.min(1, Math.abs(a) / scale) * 0.45;
      span.style.background = a >= 0 ? `rgba(40,160,90,${alpha})` : `rgba(200,40,40,${alpha})`;
    }
    span.title = `token ${i} id ${t.token_ids[i]}  mask ${mask}  advantage ${fmt(a)}` +
      (t.logprobs ? `  logprob ${fmt(t.logprobs[i])}` : "") + (t.values ? `  value ${fmt(t.values[i])}` : "") +
      (t.token_rewards && t.token_rewards[i] ? `  reward ${fmt(t.token_rewards[i])}` : "");
    box.append(span);
  });
  return box;
}

startBuilder().catch((e) => { $("#status").className = "status bad"; $("#status").textContent = "could not load the form: " + e.message; });

// #runs opens the run viewer, #runs/NAME that run, #build (or nothing) the builder; on load and on every change
// of the address in the same tab (a link, typing it, back and forward).
function route() {
  if (!location.hash.startsWith("#runs")) { showPage("page-build"); return; }
  showPage("page-runs");
  const name = decodeURIComponent(location.hash.slice(6));
  if (name && name !== viewer.run) openRun(name);
}
window.addEventListener("hashchange", route);
route();
