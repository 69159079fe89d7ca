// The chat page's settings panel: the API key a server started with --api-key asks for (kept in this
// tab's sessionStorage, gone when the tab closes), the decoding fields of /web/settings.json, kept with the
// rest of the panel in localStorage, and the request fields they make. A plain script, as app.js (loaded
// last), whose helpers ($, el, state) it shares.
"use strict";

const GROUPS = [
  ["Budget and layout", ["max_tokens", "slot_size", "block_length", "serial_num_blocks"]],
  ["Thresholds", ["slot_threshold", "token_threshold"]],
  ["Sampling", ["temperature", "seed", "top_p", "top_k", "min_p", "xtc_probability", "xtc_threshold",
                "repetition_penalty", "presence_penalty", "frequency_penalty"]],
];
const STORE = "refusion-mlx-settings";
const KEY_STORE = "refusion-mlx-api-key";

// -- the API key ----------------------------------------------------------------

function askKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message;
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      resolve(dialog.returnValue === "ok" && key ? key : null);
      // (a key outside printable ASCII cannot go in a header: authorizedFetch asks again)
    }, { once: true });
    dialog.showModal();
  });
}

// fetch with the stored key; on a 401 ask for the key (again, if the one sent was refused) and retry
const PRINTABLE = /^[\x21-\x7e]+$/;

async function authorizedFetch(path, options = {}) {
  let refused = "The server refused that key. Its API key:";
  for (;;) {
    let key = sessionStorage.getItem(KEY_STORE);
    if (key && !PRINTABLE.test(key)) { // a pasted curly quote or ellipsis: fetch would throw, never ask again
      sessionStorage.removeItem(KEY_STORE);
      const asked = await askKey("An API key is printable ASCII (no spaces, quotes or dashes typographers " +
                                 "use). Its API key:");
      if (asked === null) throw new Error("no API key given");
      sessionStorage.setItem(KEY_STORE, asked);
      continue;
    }
    const headers = { ...(options.headers || {}), ...(key ? { Authorization: "Bearer " + key } : {}) };
    const resp = await fetch(path, { ...options, headers });
    if (resp.status !== 401) return resp;
    const asked = await askKey(key ? refused : "This server needs its API key (kept in this tab only):");
    if (asked === null) return resp;
    sessionStorage.setItem(KEY_STORE, asked);
  }
}

// -- settings ------------------------------------------------------------------

async function loadSettings() {
  const resp = await authorizedFetch("web/settings.json");
  if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
  const s = await resp.json();
  $("model").textContent = s.model;
  document.title = s.model + " · refusion-mlx chat";
  const form = $("settings-form");
  s.fields.forEach((f) => { state.defaults[f.name] = f.default; });
  state.loaded = true;
  const byName = new Map(s.fields.map((f) => [f.name, f]));
  const placed = new Set();
  const groups = GROUPS.map(([title, names]) => {
    names.forEach((n) => placed.add(n));
    return [title, names.filter((n) => byName.has(n)).map((n) => byName.get(n))];
  });
  groups.push(["Other", s.fields.filter((f) => !placed.has(f.name))]);
  for (const [title, fields] of groups) {
    if (!fields.length) continue;
    const set = el("fieldset");
    set.append(el("legend", null, title));
    fields.forEach((f) => set.append(fieldInput(f)));
    form.append(set);
  }
  restoreSettings(form.querySelectorAll("input"));
}

function fieldInput(f) {
  const label = el("label", "row");
  label.title = f.help + (f.openai ? "" : " (ReFusion)");
  label.append(el("span", null, f.name));
  const input = el("input");
  input.type = "number";
  input.name = f.name;
  input.dataset.type = f.type;
  input.step = f.type === "int" ? "1" : "any";
  const low = f.ge != null ? f.ge : f.gt;
  if (low != null) input.min = low;
  if (f.le != null) input.max = f.le;
  input.placeholder = f.default == null ? "auto" : String(f.default);
  label.append(input);
  return label;
}

// The settings kept in local storage, as saveSettings writes them. Anything else (a value another version or a
// hand wrote, storage turned off) is passed over, the server's defaults apply, and the next edit replaces it.
function storedSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    if (saved !== null && typeof saved === "object" && !Array.isArray(saved)) return saved;
  } catch (e) { /* not JSON, or no storage */ }
  return {};
}

// Every setting of the panel is kept: the decoding fields by name, the rest (#panel-form: the system prompt,
// the JSON schema, the endpoint, ms per step) by id. The fields come with the server's list, the rest at once.
const settingKey = (control) => control.name || control.id;

function panelControls() {
  return [...$("settings-form").querySelectorAll("input"), ...$("panel-form").elements];
}

function restoreSettings(controls) {
  const saved = storedSettings();
  for (const control of controls) {
    const value = saved[settingKey(control)];
    if (typeof value !== "string") continue;
    if (control.tagName === "SELECT" && ![...control.options].some((o) => o.value === value)) continue;
    control.value = value;
  }
}

// On every edit, over what was kept: a setting not on the page yet (a field, before the server's list) stays.
function saveSettings() {
  const values = storedSettings();
  for (const control of panelControls()) {
    if (control.value !== "") values[settingKey(control)] = control.value;
    else delete values[settingKey(control)];
  }
  try {
    localStorage.setItem(STORE, JSON.stringify(values));
  } catch (e) { /* no storage (full, or off): the settings apply, unkept */ }
}

// The request's decoding fields: the ones set (the server checks them and names a bad one). An integer past a
// double's exact ones (a 64-bit seed: up to 2**64 - 1) is a BigInt, sent as typed (bodyJSON), not rounded.
function chosenSettings() {
  const out = {};
  for (const input of $("settings-form").querySelectorAll("input")) {
    if (input.validity.badInput) throw new Error(input.name + ": not a number");
    const value = input.value.trim();
    if (value === "") continue;
    const exact = input.dataset.type === "int" && /^-?\d+$/.test(value) && !Number.isSafeInteger(Number(value));
    out[input.name] = exact ? BigInt(value) : Number(value);
  }
  return out;
}

// A request's body as JSON, its BigInts written exactly (JSON.stringify refuses them; the decoding fields
// are at the top of every API's body).
function bodyJSON(body) {
  const entries = Object.entries(body).filter(([, v]) => v !== undefined)
    .map(([k, v]) => JSON.stringify(k) + ":" + (typeof v === "bigint" ? String(v) : JSON.stringify(v)));
  return "{" + entries.join(",") + "}";
}
