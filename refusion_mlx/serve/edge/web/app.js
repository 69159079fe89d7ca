// The refusion-mlx chat page: a multi-turn chat streamed through the API chosen
// (/v1/chat/completions, /v1/responses or /v1/messages), with the settings of settings.js, and the
// answer's slots (slots.js) as the stream's commits (stream_options.include_commits, on all three) fill
// them, out of order. Plain scripts, no modules: this one, loaded last, holds the helpers they share.
// Model text only ever goes into the page as text (textContent, title), never as HTML.
"use strict";

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
    body: (messages, system, decoding, schema) => ({
      messages, ...(system ? { system } : {}), stream: true, stream_options: { include_commits: true },
      ...(schema !== null ? { output_config: { format: { type: "json_schema", schema } } } : {}),
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
