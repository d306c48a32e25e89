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
    const hash = tab.dataset.page === "page-runs" ? runHash() : "#build";
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
// The open run (its table and traces) and the runs overlaid on its charts, each run in its own colour.
const viewer = {run: null, overview: null, step: null, timer: null, listTimer: null, rowsSeen: -1,
                compare: new Set(),  // the other runs ticked in the list, overlaid on the open run's charts
                others: new Map(),   // name -> overview of each of them
                zoom: null};         // [first step, last step] every chart shows; null: all steps
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                "#bcbd22", "#17becf"];
const DASHES = ["", "6 3", "2 3", "8 3 2 3"];  // the curves of one panel, when the colour says the run

function showRunsError(e) {
  $("#runs-root").textContent = "could not list the runs: " + e.message;
}

async function loadRuns() {
  const data = await getJSON("/api/runs");
  $("#runs-root").textContent = "runs in " + data.root + " (tick runs to overlay them on the charts)";
  $("#runs-list").replaceChildren(...data.runs.map((r) => {
    const box = el("input", {type: "checkbox", "data-compare": r.name, title: "overlay on the charts",
                             "aria-label": "overlay " + r.name + " on the charts",
                             checked: r.name === viewer.run || viewer.compare.has(r.name) || undefined,
                             disabled: r.name === viewer.run || undefined});
    box.addEventListener("change", () => toggleCompare(r.name, box.checked));
    return el("li", {}, box, el("button", {"data-run": r.name, class: r.name === viewer.run ? "active" : "",
                                           onclick: () => openRun(r.name), text: r.name + (r.finished ? "" : "  (running?)")}));
  }));
  if (!data.runs.length) $("#runs-list").append(el("li", {class: "muted", text: "no run folders with metrics.jsonl yet"}));
}

// The runs the charts show, in legend order: the open run first, then the ticked ones.
function chartRuns() {
  const out = viewer.overview ? [{name: viewer.run, overview: viewer.overview}] : [];
  for (const name of viewer.compare) if (viewer.others.has(name)) out.push({name, overview: viewer.others.get(name)});
  return out;
}

// The address of what the viewer shows: #runs/NAME?compare=OTHER,... (a comparison can be sent as a link).
function runHash() {
  if (!viewer.run) return "#runs";
  const others = [...viewer.compare].map(encodeURIComponent).join(",");
  return "#runs/" + encodeURIComponent(viewer.run) + (others ? "?compare=" + others : "");
}

function keepHash() {
  if (location.hash !== runHash()) history.replaceState(null, "", runHash());
}

async function toggleCompare(name, on) {
  if (on) viewer.compare.add(name); else { viewer.compare.delete(name); viewer.others.delete(name); }
  keepHash();
  if (on) await refreshOthers(); else redrawRuns();
}

// Fetch the ticked runs (a run that went away is unticked); redraw when one of them changed.
async function refreshOthers() {
  if (!viewer.compare.size) return;
  let changed = false;
  const listed = await getJSON("/api/runs").then((d) => new Set(d.runs.map((r) => r.name)), () => null);
  for (const name of [...viewer.compare]) {
    let o = null;
    if (!listed || listed.has(name)) o = await getJSON("/api/runs/" + encodeURIComponent(name)).catch(() => null);
    if (!o) {  // gone (or never there, from a link): no longer compared
      viewer.compare.delete(name); viewer.others.delete(name); keepHash(); changed = true; continue;
    }
    const before = viewer.others.get(name);
    if (!before || before.rows.length !== o.rows.length || before.finished !== o.finished) {
      viewer.others.set(name, o); changed = true;
    }
  }
  if (changed) redrawRuns();
}

function redrawRuns() {
  drawLegend();
  drawCharts();
  fillMetrics();
}

function drawLegend() {
  const runs = chartRuns();
  $("#legend").replaceChildren(...(runs.length > 1 ? runs.map((r, i) => el("span", {class: "legend-run", "data-run": r.name},
    el("span", {class: "swatch", style: `background:${COLORS[i % COLORS.length]}`}), r.name)) : []));
}

async function openRun(name) {
  clearInterval(viewer.timer);
  viewer.run = name; viewer.step = null; viewer.rowsSeen = -1; viewer.overview = null; viewer.zoom = null;
  viewer.compare.delete(name); viewer.others.delete(name);
  keepHash();
  for (const b of document.querySelectorAll("#runs-list button")) b.classList.toggle("active", b.dataset.run === name);
  for (const b of document.querySelectorAll("#runs-list input[data-compare]")) {
    b.disabled = b.dataset.compare === name;
    b.checked = b.dataset.compare === name || viewer.compare.has(b.dataset.compare);
  }
  for (const id of ["#traces", "#curves", "#extra-curve", "#steps", "#legend"]) $(id).replaceChildren();
  $("#traces-title").textContent = ""; $("#run-summary").textContent = ""; $("#run-title").textContent = name;
  setZoom(null);
  $("#run").classList.remove("missing");
  // a link to a run that is not there (a typo, a deleted folder) says so, without asking for it
  const listed = await getJSON("/api/runs").then((d) => d.runs.some((r) => r.name === name), () => true);
  if (name !== viewer.run) return;
  if (!listed) return runMissing(name, "it is not among the run folders listed on the left");
  if (!await refreshRun()) return;
  await refreshOthers();
  // live: a running run's new steps appear, in the open run and in the ones overlaid on it
  viewer.timer = setInterval(() => { refreshRun(); refreshOthers(); }, 3000);
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
  redrawRuns();
  renderSteps();
  return true;
}

// Each panel of curves.png, with the same panel of every overlaid run: one line per (run, curve).
function drawCharts() {
  const runs = chartRuns();
  if (!runs.length) return;
  const titles = [], panels = new Map();
  runs.forEach((r, ri) => {
    for (const p of r.overview.panels) {
      if (!panels.has(p.title)) { titles.push(p.title); panels.set(p.title, {ylabel: p.ylabel, lines: []}); }
      panels.get(p.title).lines.push(...p.curves.map((c, ci) => lineOf(runs, ri, ci, c)));
    }
  });
  $("#curves").replaceChildren(...titles.map((t) => chart(t, panels.get(t).ylabel, panels.get(t).lines)));
  drawExtra();
}

// A curve of run ``ri`` as a drawn line: one run colours its curves apart; several runs colour by run and
// tell a panel's curves apart by their dashes. Its name says the run when there are several.
function lineOf(runs, ri, ci, curve) {
  const several = runs.length > 1;
  const name = several ? `${runs[ri].name} · ${curve.label}` : curve.label;
  return {...curve, run: runs[ri].name, name, color: COLORS[(several ? ri : ci) % COLORS.length],
          dash: several ? DASHES[ci % DASHES.length] : ""};
}

// The metrics to plot, narrowed by the filter box (a part of the name: "eval/", "kl"); every chart run's keys.
function fillMetrics() {
  const runs = chartRuns();
  if (!runs.length) return;
  const extra = $("#extra-metric");
  const chosen = extra.value;
  const filter = $("#metric-filter").value.trim().toLowerCase();
  const all = [...new Set(runs.flatMap((r) => r.overview.keys))].sort();
  const keys = all.filter((k) => !filter || k.toLowerCase().includes(filter));
  extra.replaceChildren(el("option", {value: "", text: `- (${keys.length} of ${all.length})`}),
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
  const runs = chartRuns();
  if (!key || !runs.length) { $("#extra-curve").replaceChildren(); return; }
  const lines = runs.map((r, ri) => {
    const rows = r.overview.rows.filter((x) => typeof x[key] === "number");
    return lineOf(runs, ri, 0, {label: key, steps: rows.map((x) => x.step), values: rows.map((x) => x[key])});
  }).filter((l) => l.steps.length);
  $("#extra-curve").replaceChildren(chart(key, key, lines));
}

// Round tick values between y0 and y1: multiples of 1, 2 or 5 times a power of ten, 3 to 6 of them.
function niceTicks(y0, y1) {
  const raw = (y1 - y0) / 4, power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw * 0.75) || raw;
  const ticks = [];
  for (let y = Math.ceil(y0 / step - 1e-9) * step; y <= y1 + step * 1e-9; y += step) ticks.push(Number(y.toPrecision(12)));
  return ticks;
}

// Zoom to a step range (every chart), or back to all steps (null).
function setZoom(range) {
  viewer.zoom = range;
  $("#zoom-note").replaceChildren(...(range ? [`steps ${range[0]} to ${range[1]} (drag on a chart to zoom in; ` +
    "double-click one to see all steps) ", el("button", {class: "small", id: "zoom-reset", text: "all steps",
                                                          onclick: () => setZoom(null)})]
    : ["drag across a chart to zoom in"]));
  drawCharts();
}

// An SVG line chart of ``lines`` ({name, steps, values, color, dash, faint}). Smoothing, then the log scale and
// the zoom apply to every line. Hover: every line's value at the nearest step; drag: zoom to the steps
// dragged over; double-click: all steps; click: that step's traces, when it has some.
function chart(title, ylabel, lines) {
  const W = 720, H = 200, L = 50, R = 10, T = 10, B = 28;
  const weight = Number($("#smoothing").value), logScale = $("#log-scale").checked;
  const zoom = viewer.zoom;
  const drawn = lines.map((c) => {
    // log scale: only positive values can be drawn; smoothing applies to what is drawn, over the whole run
    const keep = c.values.map((v) => !logScale || v > 0);
    const steps = c.steps.filter((_, j) => keep[j]), raw = c.values.filter((_, j) => keep[j]);
    const values = smooth(logScale ? raw.map(Math.log10) : raw, weight);
    const inside = steps.map((s) => !zoom || (s >= zoom[0] && s <= zoom[1]));
    const pick = (xs) => xs.filter((_, j) => inside[j]);
    return {...c, steps: pick(steps), values: pick(values), raw: pick(raw)};
  });
  const xs = drawn.flatMap((c) => c.steps), ys = drawn.flatMap((c) => c.values);
  const panel = el("div", {class: "panel", "data-panel": title}, el("h4", {text: title}));
  if (!xs.length) {
    if (zoom) panel.append(el("div", {class: "muted", text: "nothing logged in these steps"}));
    return panel;
  }
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (zoom) [x0, x1] = zoom;
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("width", "100%");
  svg.dataset.steps = `${x0} ${x1}`;
  const add = (tag, attrs, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n); return n;
  };
  add("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"});
  add("line", {x1: L, y1: T, x2: L, y2: H - B, class: "axis"});
  for (const y of niceTicks(y0, y1)) {
    add("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end", class: "ytick"},
        logScale ? Number((10 ** y).toPrecision(2)) : Number(y.toPrecision(6)));
  }
  const every = Math.max(1, Math.ceil((x1 - x0) / 6));  // steps are whole numbers: whole, distinct ticks
  for (let x = Math.ceil(x0 / every) * every; x <= x1; x += every) {
    add("text", {x: sx(x), y: H - B + 14, "text-anchor": "middle", class: "xtick"}, x);
  }
  add("text", {x: W - R, y: H - 2, "text-anchor": "end"}, "step");
  drawn.forEach((c, i) => {
    const points = c.steps.map((s, j) => `${sx(s).toFixed(1)},${sy(c.values[j]).toFixed(1)}`).join(" ");
    add("polyline", {points, class: "curve" + (c.faint ? " faint" : ""), stroke: c.color, "stroke-dasharray": c.dash || "none",
                     "data-run": c.run, "data-label": c.label,
                     "data-values": c.values.map((v) => Number(v.toPrecision(4))).join(" ")});
    if (c.steps.length === 1) add("circle", {cx: sx(c.steps[0]), cy: sy(c.values[0]), r: 2.5, fill: c.color});
  });
  // the key: each line's name beside a stretch of the line itself; with several runs (their colours are in the
  // legend above the charts) each curve's name once, beside its dash
  const several = new Set(drawn.map((c) => c.run)).size > 1;
  const keyed = several
    ? [...new Map(drawn.map((c) => [c.label, {name: c.label, dash: c.dash, color: "#555"}])).values()] : drawn;
  keyed.forEach((c, i) => {
    add("text", {x: W - R - 30, y: T + 12 + 13 * i, "text-anchor": "end", style: `fill: ${c.color}`}, c.name);
    add("line", {x1: W - R - 26, x2: W - R - 2, y1: T + 8 + 13 * i, y2: T + 8 + 13 * i, stroke: c.color,
                 "stroke-width": 2, "stroke-dasharray": c.dash || "none"});
  });
  const markers = drawn.map((c) => add("circle", {r: 3.5, fill: "none", stroke: c.color, visibility: "hidden"}));
  const band = add("rect", {y: T, height: H - T - B, class: "zoom-band", visibility: "hidden"});
  const tooltip = $("#tooltip");
  const toStep = (evt) => {  // the step under the pointer, as a (fractional) number
    const box = svg.getBoundingClientRect();
    return x0 + ((evt.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
  };
  const nearestStep = (x) => {
    let best = null;
    for (const s of xs) if (best === null || Math.abs(s - x) < Math.abs(best - x)) best = s;
    return best;
  };
  // each line's point at ``step``, or at its own nearest step (named) when it logged nothing there
  const pointsAt = (step) => drawn.map((c, i) => {
    if (!c.steps.length) return null;
    let j = 0;
    c.steps.forEach((s, k) => { if (Math.abs(s - step) < Math.abs(c.steps[j] - step)) j = k; });
    return {i, name: c.name, step: c.steps[j], value: c.values[j], raw: c.raw[j]};
  }).filter((p) => p);
  const hide = () => { tooltip.classList.add("hidden"); for (const m of markers) m.setAttribute("visibility", "hidden"); };
  let dragFrom = null;
  svg.addEventListener("mousedown", (evt) => {
    if (evt.button !== 0) return;
    evt.preventDefault();  // no text selection while dragging
    dragFrom = {x: toStep(evt), clientX: evt.clientX};
  });
  svg.addEventListener("mousemove", (evt) => {
    const x = toStep(evt);
    if (dragFrom && Math.abs(evt.clientX - dragFrom.clientX) > 3) {
      const [a, b] = [Math.max(x0, Math.min(dragFrom.x, x)), Math.min(x1, Math.max(dragFrom.x, x))];
      band.setAttribute("x", sx(a)); band.setAttribute("width", Math.max(0, sx(b) - sx(a)));
      band.setAttribute("visibility", "visible");
    }
    const step = nearestStep(x);
    const points = pointsAt(step);
    points.forEach((p) => {
      markers[p.i].setAttribute("cx", sx(p.step)); markers[p.i].setAttribute("cy", sy(p.value));
      markers[p.i].setAttribute("visibility", "visible");
    });
    const four = (v) => Number(Number(v).toPrecision(4));
    tooltip.textContent = [`step ${step}`, ...points.map((p) => `${p.name}: ${four(p.raw)}` +
      (weight ? ` (smoothed ${four(logScale ? 10 ** p.value : p.value)})` : "") +
      (p.step !== step ? ` (at step ${p.step})` : ""))].join("\n");
    tooltip.classList.remove("hidden");
    const right = evt.clientX + 12 + tooltip.offsetWidth > window.innerWidth;  // near the right edge: on the left
    tooltip.style.left = (right ? evt.clientX - 12 - tooltip.offsetWidth : evt.clientX + 12) + "px";
    tooltip.style.top = evt.clientY + 12 + "px";
  });
  svg.addEventListener("mouseleave", () => { hide(); dragFrom = null; band.setAttribute("visibility", "hidden"); });
  svg.addEventListener("mouseup", (evt) => {
    if (!dragFrom) return;
    const from = dragFrom;
    dragFrom = null;
    band.setAttribute("visibility", "hidden");
    if (Math.abs(evt.clientX - from.clientX) > 3) {  // a drag: zoom to the steps it covered, to the nearest whole
      const [p, q] = [from.x, toStep(evt)];
      const a = Math.max(x0, Math.round(Math.min(p, q))), b = Math.min(x1, Math.round(Math.max(p, q)));
      if (b > a) { hide(); setZoom([a, b]); }
      return;
    }
    const step = nearestStep(toStep(evt));  // a click: that step's traces
    if (evt.detail === 1 && step !== null && viewer.overview && viewer.overview.trace_steps[step]) openStep(step);
  });
  svg.addEventListener("dblclick", () => { hide(); setZoom(null); });
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
  const groups = groupsOf(data.traces);
  $("#traces-title").textContent = `step ${step}: ${data.traces.length} sampled trajectories in ` +
    `${groups.length} group${groups.length === 1 ? "" : "s"} (samples sorted by advantage, best first)`;
  $("#traces").replaceChildren(...groups.map(groupNode));
}

// A step's traces as its groups (the samples of one prompt), in the order they were traced; each group's
// samples sorted by advantage, highest first (a sample without one last).
function groupsOf(traces) {
  const groups = new Map();
  for (const t of traces) {
    const key = t.group_id !== null && t.group_id !== undefined ? `${t.stage ?? ""}/${t.group_id}` : `prompt/${t.prompt}`;
    if (!groups.has(key)) groups.set(key, {key, group_id: t.group_id, samples: []});
    groups.get(key).samples.push(t);
  }
  const adv = (t) => (typeof t.advantage === "number" ? t.advantage : -Infinity);
  for (const g of groups.values()) g.samples.sort((a, b) => adv(b) - adv(a) || (a.sample_index ?? 0) - (b.sample_index ?? 0));
  return [...groups.values()];
}

// Numbers to 4 significant digits without trailing zeros (0.5, 0.7071, 3), as Python's format(v, ".4g").
function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)));
}

// One group: its prompt once, then one row per sample: advantage, score and the whole response (every turn).
function groupNode(g) {
  const first = g.samples[0];
  const scores = g.samples.map((t) => t.score).filter((s) => typeof s === "number");
  const mean = scores.length ? scores.reduce((a, b) => a + b, 0) / scores.length : null;
  const prompts = new Set(g.samples.map((t) => t.prompt));
  return el("div", {class: "group", "data-group": g.key},
    el("div", {class: "group-head"},
      el("span", {text: `group ${fmt(g.group_id)}`}), el("span", {text: `${g.samples.length} samples`}),
      el("span", {text: `mean score ${fmt(mean)}`}), el("span", {text: `row ${fmt(first.row_id)}`}),
      el("span", {text: `ground truth: ${fmt(first.ground_truth)}`})),
    promptNode(first),
    prompts.size > 1 ? el("div", {class: "muted", text: "the samples of this group had different prompts: each row shows its own"}) : null,
    el("div", {class: "samples"}, ...g.samples.map((t) => sampleNode(t, prompts.size > 1))));
}

function sampleNode(t, ownPrompt) {
  const sign = t.advantage > 0 ? "positive" : (t.advantage < 0 ? "negative" : "");
  const rewards = el("table", {class: "rewards"}, ...Object.entries(t.rewards || {}).map(([k, v]) =>
    el("tr", {}, el("td", {text: k}), el("td", {text: fmt(v)}))));
  const details = el("details", {class: "sample-details"}, el("summary", {text: "details"}),
    el("div", {class: "muted", text: `sample ${fmt(t.sample_index)}, batch row ${fmt(t.row)}, source ${fmt(t.source)}, ` +
                                     `staleness ${fmt(t.staleness)}, ${t.policy_tokens}/${t.response_tokens} policy tokens`}),
    el("div", {class: "muted", text: "reward per reward function"}), rewards,
    el("div", {class: "muted", text: "the response as decoded text (a multi-turn episode's last turn)"}),
    el("pre", {class: "response", text: t.response}));
  const info = t.info || {};
  if (Array.isArray(info.messages)) {
    details.append(el("div", {class: "muted", text: "transcript (assistant turns, tool calls, observations)"}),
      el("div", {class: "messages"}, ...info.messages.map(messageNode)));
  }
  const rest = Object.fromEntries(Object.entries(info).filter(([k]) => k !== "messages"));
  if (Object.keys(rest).length) details.append(el("div", {class: "muted", text: "workflow info"}),
                                               el("pre", {text: JSON.stringify(rest, null, 1)}));
  const meta = el("div", {class: "sample-meta"},
    el("span", {class: "advantage " + sign, text: `adv ${t.advantage > 0 ? "+" : ""}${fmt(t.advantage)}`}),
    el("span", {class: "score", "data-score": t.score, text: `score ${fmt(t.score)}`}),
    el("span", {class: "muted", text: fmt(t.finish_reason)}));
  return el("div", {class: "sample trajectory", "data-row": t.row, "data-advantage": t.advantage}, meta,
    el("div", {class: "sample-body"}, ownPrompt ? promptNode(t) : null,
       Array.isArray(t.tokens) ? tokensNode(t) : el("pre", {class: "response", text: t.response}), details));
}

// A prompt's text with the thumbnails of its images beside it (traces' "images"), when it has some.
function promptNode(t) {
  const text = el("pre", {class: "prompt", text: t.prompt});
  const images = (Array.isArray(t.images) ? t.images : []).map(imageNode).filter((n) => n);
  return images.length ? el("div", {class: "prompt-row"}, el("div", {class: "thumbs"}, ...images), text) : text;
}

// One image thumbnail of a trace: only a PNG the trace itself carries (a data: address), never a link out.
function imageNode(part) {
  if (!part || typeof part.thumbnail !== "string" || !part.thumbnail.startsWith("data:image/png;base64,")) return null;
  const size = `${fmt(part.width)} x ${fmt(part.height)} px`;
  return el("img", {class: "thumb", src: part.thumbnail, alt: `image (${size})`, title: `image, ${size} (thumbnail)`});
}

// A transcript message; content parts (text, an environment's image) in order, images as their thumbnails.
function messageNode(m) {
  const node = el("div", {class: "msg " + (m.role || ""), text: `${m.role}: `});
  if (typeof m.content === "string") node.append(m.content);
  else if (Array.isArray(m.content)) {
    for (const part of m.content) {
      const image = part && part.type === "image" ? imageNode(part) : null;
      node.append(image || (part && part.type === "text" && typeof part.text === "string" ? part.text : JSON.stringify(part)));
    }
  } else node.append(JSON.stringify(m.content));
  if (m.tool_calls) node.append("\ntool calls: " + JSON.stringify(m.tool_calls));
  return node;
}

// The whole response, token by token: every assistant turn and observation (grey: not the policy's,
// response_mask 0), coloured by advantage; hover a token for its id, log-prob, advantage. Turns are labelled
// when there are several.
function tokensNode(t) {
  const box = el("div", {class: "tokens"});
  const adv = t.advantages || [];
  const scale = Math.max(1e-6, ...adv.filter((a) => a !== null).map(Math.abs));
  const masks = Array.isArray(t.response_mask) ? t.response_mask : t.tokens.map(() => 1);
  const ids = t.token_ids || [];
  const turns = masks.some((m) => !m);
  let turn = 0, previous = null;
  t.tokens.forEach((text, i) => {
    const mask = masks[i];
    if (turns && mask !== previous) {
      box.append(el("span", {class: "turn-label", text: mask ? `[assistant turn ${++turn}]` : "[observation]"}));
      previous = mask;
    }
    const a = adv[i];
    const span = el("span", {class: "tok" + (mask ? " policy" : " obs"), "data-mask": mask, text: text});
    if (mask && a !== null && a !== undefined) {
      const alpha = Math.min(1, Math.abs(a) / scale) * 0.45;
      span.style.background = a >= 0 ? `rgba(40,160,90,${alpha})` : `rgba(200,40,40,${alpha})`;
    }
    span.title = `token ${i} id ${fmt(ids[i])}  mask ${mask}  advantage ${fmt(a)}` +
      (t.logprobs ? `  logprob ${fmt(t.logprobs[i])}` : "") + (t.values ? `  value ${fmt(t.values[i])}` : "") +
      (t.token_rewards && t.token_rewards[i] ? `  reward ${fmt(t.token_rewards[i])}` : "");
    box.append(span);
  });
  return box;
}

startBuilder().catch((e) => { $("#status").className = "status bad"; $("#status").textContent = "could not load the form: " + e.message; });

// #runs opens the run viewer, #runs/NAME that run (?compare=A,B: with those runs on its charts), #build (or
// nothing) the builder; on load and on every change
// of the address in the same tab (a link, typing it, back and forward).
function route() {
  if (!location.hash.startsWith("#runs")) { showPage("page-build"); return; }
  showPage("page-runs");
  const decode = (x) => { try { return decodeURIComponent(x); } catch { return x; } };  // a mistyped "%"
  const [path, query] = location.hash.slice(6).split("?");
  const name = decode(path);
  const listed = ((query || "").match(/(?:^|&)compare=([^&]*)/) || ["", ""])[1];  // split, then decode: a name may hold ","
  const compare = listed.split(",").map(decode).filter((n) => n && n !== name);
  const same = compare.length === viewer.compare.size && compare.every((n) => viewer.compare.has(n));
  if (!same) {
    viewer.compare = new Set(compare);
    for (const n of [...viewer.others.keys()]) if (!viewer.compare.has(n)) viewer.others.delete(n);
    for (const b of document.querySelectorAll("#runs-list input[data-compare]")) b.checked = b.disabled || viewer.compare.has(b.dataset.compare);
  }
  if (name && name !== viewer.run) openRun(name);
  else if (!same) refreshOthers().then(() => { redrawRuns(); keepHash(); });
}
window.addEventListener("hashchange", route);
route();
