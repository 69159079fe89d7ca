// The chat page's slot view: an answer's positions, block by block, each token as the step that committed
// it (the stream's commits, stream_options.include_commits), out of order. A plain script, as app.js (loaded
// last), whose helpers ($, el, state) it shares. Model text goes in as text only (textContent, title).
"use strict";

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
