// The refusion-mlx chat page: a multi-turn chat streamed through the API chosen
// (/v1/chat/completions, /v1/responses or /v1/messages), the decoding settings of
// /web/settings.json, and the answer's slots as the stream's commits
// (stream_options.include_commits, on all three) fill them, out of order.
// Model text only ever goes into the page as text (textContent, title), never as HTML.
// A server started with --api-key answers 401 until the page sends its key: the page asks
// for it once and keeps it in this tab's sessionStorage (gone when the tab closes).
"use strict";

const GROUPS = [
  ["Budget and layout", ["max_tokens", "slot_size", "block_length", "serial_num_blocks"]],
  ["Thresholds", ["slot_threshold", "token_threshold"]],
  ["Sampling", ["temperature", "seed", "top_p", "top_k", "min_p"]],
];
const STORE = "refusion-mlx-settings";
const KEY_STORE = "refusion-mlx-api-key";

const $ = (id) => document.getElementById(id);
const state = { history: [], busy: false, controller: null, shown: null, defaults: {}, loaded: false };

// Each API: its path, its body for the conversation, and what one of its stream's events
// says, as { text, commits, finish, usage: { completion, prompt, cached, tpf }, error }.
const APIS = {
  chat: {
    path: "v1/chat/completions",
    body: (messages, system, decoding, schema) => ({
      messages: (system ? [{ role: "system", content: system }] : []).concat(messages),
      stream: true, stream_options: { include_usage: true, include_commits: true }, ...decoding,
      ...(schema !== null ? { response_format: { type: "json_schema", json_schema: { name: "page", schema } } }
                          : {}),
    }),
    read: (name, d) => {
      const choice = d.choices && d.choices[0];
      const u = d.usage;
      return {
        text: choice && choice.delta && choice.delta.content, finish: choice && choice.finish_reason,
        commits: d.commits, error: d.error && d.error.message,
        usage: u && { completion: u.completion_tokens, prompt: u.prompt_tokens, tpf: u.tokens_per_forward,
                      cached: u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens },
      };
    },
  },
  responses: {
    path: "v1/responses",
    body: (messages, system, decoding, schema) => {
      const { max_tokens, ...rest } = decoding;
      return { input: messages, ...(system ? { instructions: system } : {}), store: false, stream: true,
               stream_options: { include_commits: true },
               ...(schema !== null ? { text: { format: { type: "json_schema", name: "page", schema } } } : {}),
               ...(max_tokens != null ? { max_output_tokens: max_tokens } : {}), ...rest };
    },
    read: (name, d) => {
      if (name === "response.output_text.delta") return { text: d.delta };
      if (name === "response.commits") return { commits: d.commits };
      if (name === "response.failed") return { error: d.response.error.message };
      if (name !== "response.completed" && name !== "response.incomplete") return {};
      const u = d.response.usage;
      return { finish: d.response.status, usage: { completion: u.output_tokens, prompt: u.input_tokens,
               cached: u.input_tokens_details.cached_tokens, tpf: u.tokens_per_forward } };
    },
  },
  messages: {
    path: "v1/messages",
    body: (messages, system, decoding) => ({
      messages, ...(system ? { system } : {}), stream: true, stream_options: { include_commits: true },
      ...decoding, max_tokens: decoding.max_tokens != null ? decoding.max_tokens : state.defaults.max_tokens,
    }),
    read: (name, d) => {
      if (name === "content_block_delta" && d.delta.type === "text_delta") return { text: d.delta.text };
      if (name === "commits") return { commits: d.commits };
      if (name === "error") return { error: d.error.message };
      if (name !== "message_delta") return {};
      const u = d.usage;
      return { finish: d.delta.stop_reason, usage: { completion: u.output_tokens, tpf: u.tokens_per_forward,
               prompt: u.input_tokens + u.cache_read_input_tokens, cached: u.cache_read_input_tokens } };
    },
  },
};

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text != null) node.textContent = text;
  return node;
}

function setStatus(text, kind) {
  const s = $("status");
  s.textContent = text;
  s.dataset.kind = kind || "";
}

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

// -- the slot view ---------------------------------------------------------------

function newTurn() {
  return { blocks: [], cells: new Map(), step: 0, phase: "", fresh: new Set(), eos: null, slotSize: 0,
           byStep: new Map(), dirty: new Set(), dirtySteps: new Set() };
}

function applyCommits(turn, commits) {
  if (commits.blocks) turn.blocks = commits.blocks;
  turn.fresh = new Set();
  for (const slot of commits.slots) {
    turn.slotSize = Math.max(turn.slotSize, slot.positions.length);
    slot.positions.forEach((pos, i) => {
      const piece = slot.pieces[i];
      const old = turn.cells.get(pos);
      if (old) { // committed again (not expected): it leaves its earlier step's line
        const before = turn.byStep.get(old.step);
        before.positions = before.positions.filter((p) => p !== pos);
        turn.dirtySteps.add(old.step);
      }
      turn.cells.set(pos, { piece, id: slot.ids[i], step: commits.step, phase: commits.phase });
      if (!turn.byStep.has(commits.step)) turn.byStep.set(commits.step, { phase: commits.phase, positions: [] });
      turn.byStep.get(commits.step).positions.push(pos);
      turn.dirtySteps.add(commits.step);
      turn.dirty.add(pos);
      turn.fresh.add(pos);
      if (piece === null && (turn.eos === null || pos < turn.eos)) turn.eos = pos;
    });
  }
  if (commits.step) {
    turn.step = commits.step;
    turn.phase = commits.phase;
  }
}

function pieceText(piece) {
  if (piece === null) return "⏎";
  let s = piece.replace(/\n/g, "↵").replace(/\t/g, "→");
  s = s.trim() === "" ? s.replace(/ /g, "␣") : s.replace(/ /g, "\u00a0");
  return s || "·";
}

function stepColour(step, last) {
  const t = last > 1 ? (step - 1) / (last - 1) : 0;
  return `hsl(${Math.round(215 - 185 * t)}, 75%, ${Math.round(86 - 6 * t)}%)`;
}

// What the slot view shows now: a long answer's stream only touches the cells and step lines that changed
// (a rebuild on every commit made the page's work grow with the square of the answer's length).
const view = { turn: null, blocks: null, end: -1, nodes: [], fresh: [], colouredAt: 0, rows: new Map() };

function renderGrid(turn) {
  const total = turn.blocks.reduce((a, b) => a + b, 0);
  const end = turn.eos === null ? total : Math.min(total, turn.eos + 1);
  const whole = view.turn !== turn || view.blocks !== turn.blocks || view.end !== end;
  if (whole) {
    buildGrid(turn, end);
  } else {
    for (const pos of view.fresh) view.nodes[pos].classList.remove("fresh");
    for (const pos of turn.dirty) if (pos < end) fillCell(view.nodes[pos], turn, pos);
  }
  view.fresh = [...turn.fresh].filter((pos) => pos < end);
  for (const pos of view.fresh) view.nodes[pos].classList.add("fresh");
  if (whole || view.colouredAt !== turn.step) { // the colours run from the first step to the last one
    for (const [pos, cell] of turn.cells) if (pos < end) view.nodes[pos].style.background = stepColour(cell.step, turn.step);
  }
  renderSteps(turn, end, whole);
  view.colouredAt = turn.step;
  turn.dirty.clear();
  turn.dirtySteps.clear();
  let done = 0;
  for (const pos of turn.cells.keys()) if (pos < end) done++;
  $("slot-caption").textContent = turn.step
    ? `step ${turn.step} · ${turn.phase} · ${done} of ${end} committed`
    : `${end} positions, nothing committed yet`;
}

function buildGrid(turn, end) {
  Object.assign(view, { turn, blocks: turn.blocks, end, nodes: [], fresh: [] });
  const blocks = [];
  let start = 0;
  for (const length of turn.blocks) {
    if (start >= end) break;
    const block = el("div", "block");
    for (let pos = start; pos < Math.min(start + length, end); pos++) {
      const node = el("span", "cell");
      node.dataset.pos = pos;
      if (turn.slotSize && pos > start && (pos - start) % turn.slotSize === 0) node.classList.add("slot-start");
      fillCell(node, turn, pos);
      view.nodes.push(node);
      block.append(node);
    }
    blocks.push(block);
    start += length;
  }
  $("grid").replaceChildren(...blocks);
}

function fillCell(node, turn, pos) {
  const cell = turn.cells.get(pos);
  if (cell) {
    node.classList.remove("masked");
    node.dataset.step = cell.step;
    node.style.background = stepColour(cell.step, turn.step);
    node.classList.toggle("eos", cell.piece === null);
    node.title = `position ${pos} · step ${cell.step} (${cell.phase}) · token id ${cell.id}`;
    node.replaceChildren(el("span", "t", pieceText(cell.piece)), el("span", "s", String(cell.step)));
  } else {
    node.classList.add("masked");
    node.title = `position ${pos} · masked`;
    node.replaceChildren(el("span", "t", "\u00a0"), el("span", "s", "\u00a0"));
  }
}

// One line per step: its colour, phase, how many tokens it committed and where. A stream's steps come in
// order: a new one is a line added at the end, and only the lines of the steps that changed are redrawn.
function renderSteps(turn, end, whole) {
  const list = $("steps");
  const last = view.rows.size ? Math.max(...view.rows.keys()) : 0;
  if (!whole && [...turn.dirtySteps].some((step) => !view.rows.has(step) && step < last)) whole = true;
  if (whole) {
    view.rows = new Map();
    list.replaceChildren();
  }
  const steps = whole ? [...turn.byStep.keys()] : [...turn.dirtySteps];
  for (const step of steps.sort((a, b) => a - b)) {
    const row = stepRow(turn, step, end);
    const old = view.rows.get(step);
    if (old && row) old.replaceWith(row);
    else if (old) old.remove();
    else if (row) list.append(row);
    if (row) view.rows.set(step, row);
    else view.rows.delete(step);
  }
  if (!whole && view.colouredAt !== turn.step) {
    for (const [step, row] of view.rows) row.firstChild.style.background = stepColour(step, turn.step);
  }
}

function stepRow(turn, step, end) {
  const { phase, positions } = turn.byStep.get(step);
  const shown = positions.filter((pos) => pos < end);
  if (!shown.length) return null;
  const row = el("li");
  const swatch = el("span", "swatch");
  swatch.style.background = stepColour(step, turn.step);
  row.append(swatch, el("span", null, `step ${step} · ${phase} · ${shown.length} tokens at ${ranges(shown)}`));
  return row;
}

function ranges(positions) {
  const sorted = [...positions].sort((a, b) => a - b);
  const out = [];
  for (const p of sorted) {
    const last = out[out.length - 1];
    if (last && last[1] === p - 1) last[1] = p;
    else out.push([p, p]);
  }
  return out.map(([a, b]) => (a === b ? `${a}` : `${a}–${b}`)).join(", ");
}

function show(turn, msg) {
  state.shown = turn;
  for (const m of document.querySelectorAll(".msg.shown")) m.classList.remove("shown");
  if (msg) msg.classList.add("shown");
  renderGrid(turn);
}

// -- the chat ----------------------------------------------------------------------

function addMessage(role, text) {
  const msg = el("div", "msg " + role);
  const body = el("div", "body", text);
  body.dir = "auto"; // right-to-left text reads right to left
  msg.append(el("div", "who", role), body, el("div", "meta"));
  $("messages").append(msg);
  return msg;
}

// A change to the chat (an answer's text, the line under it): the chat follows it down only if it was read at
// its bottom, so the newest turn stays in view whole, and a reader scrolled up to an earlier one is left there.
function changeChat(change) {
  const list = $("messages");
  const following = list.scrollHeight - list.scrollTop - list.clientHeight < 24;
  change();
  if (following) list.scrollTop = list.scrollHeight;
}

// While an answer streams the box stays open and keeps the keyboard: the next question can be typed, Enter
// sends nothing until the answer ends (a second Enter is not a Stop), and Escape or the Stop button stops it.
// The keyboard moves only from the button that hides (Send, then Stop) to the box, never from elsewhere.
function setBusy(busy) {
  const hiding = document.activeElement === $(busy ? "send" : "stop");
  state.busy = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  if (hiding) $("input").focus();
}

// Drawing waits for the next animation frame: a burst of events (a long answer, a stream read at once) is
// drawn once, not once per event. flush() draws what is pending now (a stream's end, a paced step).
const drawing = { frame: 0, pending: new Set() };

function draw(what) {
  drawing.pending.add(what);
  if (!drawing.frame) drawing.frame = requestAnimationFrame(flush);
}

function flush() {
  cancelAnimationFrame(drawing.frame);
  drawing.frame = 0;
  const pending = [...drawing.pending];
  drawing.pending.clear();
  pending.forEach((what) => what());
}

// A long read yields to the page now and then (a message, not a timer: a hidden tab's timers are slowed),
// so Stop, typing and drawing go on while a burst of events is handled.
function yielder() {
  let since = performance.now();
  return async () => {
    if (performance.now() - since < 12) return;
    await new Promise((resolve) => {
      const channel = new MessageChannel();
      channel.port1.onmessage = resolve;
      channel.port2.postMessage(null);
    });
    since = performance.now();
  };
}

// a pause between replayed steps that Stop ends at once
const sleep = (ms, signal) => new Promise((resolve, reject) => {
  const timer = setTimeout(resolve, ms);
  signal.addEventListener("abort", () => {
    clearTimeout(timer);
    reject(new DOMException("stopped", "AbortError"));
  }, { once: true });
});

async function send(text) {
  if (!state.loaded) { // a key dialog cancelled at load, or the server down then: the settings first
    try {
      await loadSettings();
    } catch (e) {
      setStatus("cannot read the settings: " + e.message, "error");
      return;
    }
  }
  let decoding;
  try {
    decoding = chosenSettings();
  } catch (e) {
    setStatus(e.message, "error");
    return;
  }
  const system = $("system").value.trim();
  let schema = null; // the JSON-schema box: the answer is decoded under it (constrained decoding)
  const schemaText = $("json-schema").value.trim();
  if (schemaText) {
    try {
      schema = JSON.parse(schemaText);
    } catch (e) {
      setStatus("JSON schema: not valid JSON (" + e.message + ")", "error");
      return;
    }
    if (typeof schema !== "boolean" && (typeof schema !== "object" || schema === null || Array.isArray(schema))) {
      setStatus("JSON schema: a schema is an object (or true / false), got " + schemaText.slice(0, 40), "error");
      return;
    }
    if ($("api").value === "messages") {
      setStatus("JSON schema: the Messages API has no structured output; use Chat Completions or Responses",
                "error");
      return;
    }
  }
  $("input").value = ""; // checked: the message leaves the box (an error above left it there)
  const history = state.history; // this conversation's (New chat starts another)
  history.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const turn = newTurn();
  const msg = addMessage("assistant", "");
  msg.classList.add("streaming");
  msg.scrollIntoView({ block: "end" }); // a new turn: the chat goes to its end (the cursor's line in view)
  msg.addEventListener("click", () => show(turn, msg));
  msg.tabIndex = 0; // the keyboard's way to an answer's slots: Enter or Space on it
  msg.addEventListener("keydown", (e) => {
    if (e.target === msg && (e.key === "Enter" || e.key === " ")) {
      e.preventDefault();
      show(turn, msg);
    }
  });
  show(turn, msg);
  const api = APIS[$("api").value];
  const body = api.body(history, system, decoding, schema);
  const pace = Number($("pace").value) || 0;
  const controller = new AbortController();
  state.controller = controller;
  const stopped = () => { // Stop or New chat: even when the whole stream had already arrived
    if (controller.signal.aborted) throw new DOMException("stopped", "AbortError");
  };
  setBusy(true);
  setStatus("streaming…", "busy");
  let answer = "";
  let finish = null;
  const t0 = performance.now();
  const redraw = () => { // this answer's text and, if shown, its slots
    const body = msg.querySelector(".body");
    if (body.textContent !== answer) changeChat(() => { body.textContent = answer; });
    if (state.shown === turn) renderGrid(turn);
  };
  const onEvent = async (name, data) => {
    const e = api.read(name, data);
    if (e.error) throw new Error(e.error);
    if (e.text) answer += e.text;
    if (e.finish) finish = e.finish;
    if (e.commits) applyCommits(turn, e.commits);
    draw(redraw);
    if (e.commits && pace && e.commits.step) {
      flush(); // each step's frame, held
      await sleep(pace, controller.signal);
    }
    if (e.usage) {
      const u = e.usage;
      const secs = ((performance.now() - t0) / 1000).toFixed(2);
      const parts = [`${u.completion} tokens`, `${turn.step} steps`];
      if (u.tpf != null) parts.push(`${u.tpf} tokens/forward`);
      if (u.cached) parts.push(`${u.cached} of ${u.prompt} prompt tokens cached`);
      parts.push(`${secs} s`, `finish: ${finish}`);
      changeChat(() => { msg.querySelector(".meta").textContent = parts.join(" · "); });
    }
  };
  try {
    const resp = await authorizedFetch(api.path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: bodyJSON(body),
      signal: controller.signal,
    });
    if (!resp.ok) {
      let message = `${resp.status} ${resp.statusText}`;
      try {
        message = (await resp.json()).error.message;
      } catch (e) { /* not our error body */ }
      throw new Error(message);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    const breathe = yielder();
    for (;;) {
      // a body broken off (a server killed, a proxy's reset) ends as a closed one does, checked below
      const { value, done } = await reader.read().catch(() => { stopped(); return { done: true }; });
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let name = null;
        for (const line of event.split("\n")) {
          if (line.startsWith("event: ")) name = line.slice(7);
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          await breathe();
          stopped();
          await onEvent(name, JSON.parse(line.slice(6)));
        }
      }
    }
    stopped();
    // a stream cut before the API's finish (a proxy's timeout, a server gone) is not an answer: as a network
    // error, it is shown as one, and it and its question leave the conversation
    if (finish === null) throw new Error("the connection closed before the answer finished");
    keep(history, answer);
    current(controller, "ready", "");
  } catch (e) {
    if (e.name === "AbortError") {
      keep(history, answer);
      finish = "stopped";
      const note = answer ? "stopped" : "stopped before any text (left out)";
      changeChat(() => {
        if (!answer) leaveOut(question);
        msg.querySelector(".meta").textContent = note;
      });
      current(controller, "stopped", "");
    } else {
      history.pop(); // the failed question leaves the conversation, and goes back to the box to be sent again
      if (!$("input").value) $("input").value = text; // (unless a next one is being typed there)
      changeChat(() => {
        leaveOut(question);
        msg.classList.add("error");
        msg.querySelector(".meta").textContent = "error: " + e.message;
      });
      current(controller, "error", "error");
    }
  } finally {
    flush();
    msg.classList.remove("streaming");
    msg.dataset.finish = finish || "error";
    turn.fresh = new Set();
    if (state.shown === turn) renderGrid(turn);
    setBusy(false);
  }
}

// The answer joins the conversation; an empty one (stopped before any text) leaves with its question, as
// the Messages API refuses an empty assistant turn.
function keep(history, answer) {
  if (answer) history.push({ role: "assistant", content: answer });
  else history.pop();
}

// A question that left the conversation (its answer failed, or was stopped before any text) stays on screen,
// marked: it is not sent with the next turn.
function leaveOut(question) {
  question.classList.add("left-out");
  question.querySelector(".meta").textContent = "left out of the conversation";
}

// The status of a turn that is still the page's (not one that New chat left behind).
function current(controller, text, kind) {
  if (state.controller === controller) setStatus(text, kind);
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.controller = null; // the stopped turn is not this chat's: its status is not shown
  state.history = [];
  $("messages").replaceChildren();
  show(newTurn());
  setStatus("ready", "");
}

function main() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.busy) return;
    send(text.replace(/^\s*\n/, "").trimEnd()); // blank lines around it go; a first line's indent stays
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) { // not an IME's Enter
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  document.addEventListener("keydown", (e) => { // Escape stops a stream (not when it closes the key dialog)
    if (e.key === "Escape" && state.busy && state.controller && !$("key-dialog").open) state.controller.abort();
  });
  $("new-chat").addEventListener("click", newChat);
  for (const form of [$("settings-form"), $("panel-form")]) form.addEventListener("input", saveSettings);
  restoreSettings($("panel-form").elements);
  $("reset").addEventListener("click", () => { // every setting back to its default, and none kept
    $("settings-form").reset();
    $("panel-form").reset();
    try {
      localStorage.removeItem(STORE);
    } catch (e) { /* no storage */ }
  });
  show(newTurn());
  loadSettings()
    .then(() => setStatus("ready", ""))
    .catch((e) => setStatus("cannot read the settings: " + e.message, "error"));
}

main();
