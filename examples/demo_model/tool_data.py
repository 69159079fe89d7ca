"""Tool calls and JSON for the demo model: the training rows of retrain.py's phase 3, and its held-out checks.

Two tools, in OpenAI's function format (the server passes a request's
``tools`` to the chat template, which lists them as Qwen3 does):

* ``lookup_person`` (``{"name": ...}``) returns a person's facts as a JSON
  object, ``{"name", "city", "job", "pet", "pet_name"}``;
* ``calculator`` (``{"expression": "35 + 90"}``) returns the result as text.

Row kinds (each a ``{"messages", "tools", "family"}`` row in mlx-lm's chat
format; the trainer learns the last message, a call as the template renders it):

* ``tool_call``: a question about a person (the mix's six templates) with
  ``lookup_person`` offered, or an arithmetic one (the mix's nine) with
  ``calculator`` offered -> the call; alone or after earlier turns;
* ``tool_answer``: the same, with the call and the tool's result in the
  context -> the answer in the mix's words, from the result (arithmetic the
  model cannot do; people outside the 25 it has never seen);
* ``tool_direct``: tools offered, a question no offered tool serves -> the
  mix's answer, no call;
* ``json``: "Give Sven's facts as JSON." -> the object ``lookup_person``
  returns, no tools;
* ``tool_other_call``: a question one of the other tools serves (the weather,
  the time, a web search, an email) with it offered -> its call;
* ``tool_other``: a round trip whose result is not the shape the answers
  above come from (some of a person's facts, "not found", another tool's
  result, as text or JSON) -> an answer in text from it, never a second call
  (a client's own tools return anything; a model that calls again after
  every result never ends an agent's turn).

Held out of training, whatever the seed: one question template per known
person (25 prompts), ten names outside the 25, one in eight operand pairs,
one JSON template per person, the other tools' ``HELD_OUT_PLACES`` and
``HELD_OUT_TOPICS``. ``eval_files`` writes checks over them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PERSON_TEMPLATES = ("Who is {n}?", "Tell me about {n}.", "Describe {n}.", "What pet does {n} have?",
                    "What is the job of {n}?", "Where does {n} live?")
ARITH_TEMPLATES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Please {verb} {a} and {b}.")
OPS = (("+", "add"), ("-", "subtract"), ("*", "multiply"))
JSON_TEMPLATES = ("Give {n}'s facts as JSON.", "Write {n}'s facts as a JSON object.",
                  "Return the facts about {n} in JSON.", "Show {n} as JSON.")
# people outside the mix's 25: tool round trips only (their facts come from the tool)
NEW_NAMES = ("Aiko", "Boris", "Clara", "Diego", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jakob", "Kofi",
             "Lior", "Mira", "Nils", "Olga", "Pablo", "Rhea", "Sami", "Tomas", "Ulla", "Vera", "Wim",
             "Yusuf", "Zelda", "Anton", "Bea", "Cyrus", "Dina", "Ezra", "Freya")
HELD_OUT_NAMES = ("Gus", "Hedda", "Igor", "Jun", "Kira", "Leon", "Maya", "Noor", "Otto", "Pia")
FACTS = re.compile(r"(\w+) lives in (\w+)\. \1 works as an? (\w+)\. \1 has an? (\w+) named (\w+)\.")
Person = Tuple[str, str, str, str]  # city, job, pet, pet name
TOOLED = ("people", "addition", "subtraction", "multiplication")  # the mix's families a tool serves
MAX_CHARS = 1500  # a row with tools, as JSON (tokens: about half as many)
# system messages a conversation with tools may start with (agent frameworks send their instructions as one)
SYSTEMS = ("You are a helpful assistant.", "Be brief.", "Use the tools when they help.",
           "Answer the user's question.", "You are a helpful assistant. Use the tools if needed.", "Be precise.")
HELD_OUT_SYSTEMS = ("Use the calculator.", "You are an assistant with tools.", "Answer briefly.")


def function(name: str, description: str, properties: Dict[str, Tuple[str, str]]) -> dict:
    """An OpenAI function tool whose string parameters are all required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t, "description": d} if d else {"type": t}
                                                        for k, (t, d) in properties.items()},
                       "required": list(properties)}}}


LOOKUP_PERSON = function("lookup_person", "Look up a person's city, job and pet.",
                         {"name": ("string", "The person's first name.")})
CALCULATOR = function("calculator", "Evaluate an arithmetic expression.",
                      {"expression": ("string", "Such as 12 * 7.")})
DECOYS = (function("get_weather", "Get the weather in a city.", {"city": ("string", "")}),
          function("send_email", "Send an email.", {"to": ("string", ""), "body": ("string", "")}),
          function("get_time", "The current time in a time zone.", {"timezone": ("string", "")}),
          function("search_web", "Search the web.", {"query": ("string", "")}))
DESCRIPTIONS = {"lookup_person": ("Look up a person's city, job and pet.", "Find facts about a person.",
                                  "Get a person's facts by name."),
                "calculator": ("Evaluate an arithmetic expression.", "A calculator.",
                               "Compute the value of a math expression.")}


TOOLS_BY_NAME = {t["function"]["name"]: t for t in (LOOKUP_PERSON, CALCULATOR) + DECOYS}
# the other tools' questions (tool_other rows): places, topics and notes; the held-out ones only in the checks
PLACES = ("Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Riga", "Accra", "Dakar", "Porto", "Turin", "Minsk",
          "Kyoto", "Lagos", "Delhi", "Hanoi", "Bern", "Osaka", "Nairobi", "Madrid", "Vienna", "Lisbon")
HELD_OUT_PLACES = ("Tokyo", "Boston", "Dublin", "Seoul", "Zagreb")
TOPICS = ("red apples", "green tea", "old maps", "fast trains", "paper boats", "sea birds", "warm bread",
          "blue whales", "wild honey", "small robots", "jazz music", "snow owls")
HELD_OUT_TOPICS = ("river stones", "silver bikes", "tall ships")
NOTES = ("see you soon", "thank you", "the meeting is at noon", "happy birthday", "call me back")
SKIES = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy")
WEATHER_TEMPLATES = ("What is the weather in {p}?", "How is the weather in {p}?", "What's the weather like in {p}?")
TIME_TEMPLATES = ("What time is it in {p}?", "What is the time in {p}?")
SEARCH_TEMPLATES = ("Search the web for {t}.", "Look up {t} online.")
EMAIL_TEMPLATES = ("Send an email to {n} saying {b}.", "Email {n}: {b}.")
FIELD_SENTENCES = {"city": "{n} lives in {v}.", "job": "{n} works as a {v}."}


def variant(tool: dict, rng: random.Random) -> dict:
    """``tool`` as clients write it: another description, parameter
    descriptions dropped, or OpenAI's strict mode (SDKs and agent frameworks differ)."""
    fn = json.loads(json.dumps(tool["function"]))
    if fn["name"] in DESCRIPTIONS and rng.random() < 0.5:
        fn["description"] = rng.choice(DESCRIPTIONS[fn["name"]])
    if rng.random() < 0.3:
        for prop in fn["parameters"]["properties"].values():
            prop.pop("description", None)
    if rng.random() < 0.2:
        fn["parameters"]["additionalProperties"] = False
        fn["strict"] = True
    return {"type": "function", "function": fn}


def people_facts(rows: Sequence[dict]) -> Dict[str, Person]:
    """The 25 people's facts, read off the mix's full descriptions."""
    people = {}
    for row in rows:
        m = FACTS.fullmatch(row["messages"][-1]["content"])
        if m:
            people[m[1]] = (m[2], m[3], m[4], m[5])
    return people


# the JSON family's object as a JSON Schema (tool_eval.py --constrained decodes it under this)
FACTS_SCHEMA = {"type": "object", "properties": {k: {"type": "string"} for k in ("name", "city", "job", "pet",
                                                                                "pet_name")},
                "required": ["name", "city", "job", "pet", "pet_name"], "additionalProperties": False}


def facts_json(name: str, person: Person) -> str:
    """The JSON object ``lookup_person`` returns, and the JSON family's answer."""
    city, job, pet, pet_name = person
    return json.dumps({"name": name, "city": city, "job": job, "pet": pet, "pet_name": pet_name})


def person_answer(template: int, name: str, person: Person) -> str:
    """The mix's answer to PERSON_TEMPLATES[template] about ``name``."""
    city, job, pet, pet_name = person
    parts = {"city": f"{name} lives in {city}.", "job": f"{name} works as a {job}.",
             "pet": f"{name} has a {pet} named {pet_name}."}
    if template < 3:
        return " ".join(parts.values())
    return parts[("pet", "job", "city")[template - 3]]


def arithmetic(a: int, op: int, b: int, template: int) -> Tuple[str, str, str, str]:
    """(question, expression, result, the mix's answer)."""
    sym, verb = OPS[op]
    result = str(a + b if sym == "+" else a - b if sym == "-" else a * b)
    question = ARITH_TEMPLATES[template].format(a=a, b=b, op=sym, verb=verb)
    expression = f"{a} {sym} {b}"
    return question, expression, result, f"{expression} = {result}. The answer is {result}."


def made_up_name(rng: random.Random, taken: set) -> str:
    """A name of two or three syllables no person of the mix and no held-out name has (so a call learns
    to copy the name it is asked about, not to recall one of a few it has seen)."""
    onsets, vowels = "bcdfghjklmnprstvwz", "aeiou"
    while True:
        name = "".join(rng.choice(onsets) + rng.choice(vowels) + ("" if rng.random() < 0.6 else rng.choice("nrls"))
                       for _ in range(rng.randint(2, 3))).capitalize()
        if name not in taken:
            return name


def held_out_person(names: Sequence[str], name: str, template: int) -> bool:
    """One question template per known person (by the sorted names) is never trained with tools."""
    return template == sorted(names).index(name) % len(PERSON_TEMPLATES)


def held_out_json(names: Sequence[str], name: str, template: int) -> bool:
    return template == sorted(names).index(name) % len(JSON_TEMPLATES)


def held_out_pair(a: int, op: int, b: int) -> bool:
    """One operand pair in eight is never trained with tools."""
    return (31 * a + 17 * b + op) % 8 == 0


def call_message(name: str, arguments: dict, call_id: str, as_string: bool) -> dict:
    """An assistant message with one call, as OpenAI clients send it back (arguments often a JSON string)."""
    args = json.dumps(arguments) if as_string else arguments
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


class ToolTask:
    """One question a tool serves: its call, the tool's result and the final answer."""

    def __init__(self, question: str, tool: str, arguments: dict, result: str, answer: str):
        self.question, self.tool, self.arguments, self.result, self.answer = \
            question, tool, arguments, result, answer

    def messages(self, upto: str, rng: random.Random, call_id: str) -> List[dict]:
        """The turn's messages up to the ``call`` or the ``answer``."""
        call = call_message(self.tool, self.arguments, call_id, rng.random() < 0.5)
        out = [{"role": "user", "content": self.question}, call]
        if upto == "answer":
            out += [{"role": "tool", "tool_call_id": call_id, "content": self.result},
                    {"role": "assistant", "content": self.answer}]
        return out


class Builder:
    """Draws the rows; ``held_out`` picks the held-out questions instead of the trained ones."""

    def __init__(self, people: Dict[str, Person], plain: Sequence[dict], rng: random.Random, held_out: bool,
                 systems: float = 0.0, system_seed: int = 0, made_up: float = 0.0):
        from refusion_mlx.train.accuracy import family_of_prompt

        self.people, self.plain, self.rng, self.held_out = people, list(plain), rng, held_out
        # a share of rows with tools start with a system message, drawn apart from ``rng``
        # (the rows drawn without them stay the same)
        self.systems, self.system_rng = systems, random.Random(system_seed)
        # earlier plain turns of a conversation with tools: no question a tool would serve
        # (and short answers: a row with tools is long already)
        self.untooled = [r for r in self.plain if family_of_prompt(r["messages"][0]["content"]) not in TOOLED
                         and len(r["messages"][1]["content"]) <= 100]
        self.names = sorted(people)
        self.made_up = made_up  # share of unknown people's names made up (never a known or held-out one)
        self.pools = [sorted({p[i] for p in people.values()}) for i in range(4)]
        self.calls = 0

    def person_task(self, known: Optional[bool] = None) -> ToolTask:
        rng = self.rng
        known = rng.random() < 0.6 if known is None else known
        while True:
            template = rng.randrange(len(PERSON_TEMPLATES))
            if known:
                name = rng.choice(self.names)
                if held_out_person(self.names, name, template) != self.held_out:
                    continue
                person = self.people[name]
            else:
                if not self.held_out and self.made_up and rng.random() < self.made_up:
                    name = made_up_name(rng, set(self.names) | set(HELD_OUT_NAMES))
                else:
                    name = rng.choice(HELD_OUT_NAMES if self.held_out else NEW_NAMES)
                person = tuple(rng.choice(pool) for pool in self.pools)
            return ToolTask(PERSON_TEMPLATES[template].format(n=name), "lookup_person", {"name": name},
                            facts_json(name, person), person_answer(template, name, person))

    def arithmetic_task(self) -> ToolTask:
        rng = self.rng
        while True:
            op = rng.randrange(3)
            a, b = rng.randint(2, 99), rng.randint(2, 12 if op == 2 else 99)
            if held_out_pair(a, op, b) == self.held_out:
                question, expression, result, answer = arithmetic(a, op, b, rng.randrange(3))
                return ToolTask(question, "calculator", {"expression": expression}, result, answer)

    def task(self) -> ToolTask:
        return self.person_task() if self.rng.random() < 0.5 else self.arithmetic_task()

    def tools_for(self, needed: Sequence[str]) -> List[dict]:
        """Tools offered: the ``needed`` ones, sometimes the other one, sometimes a decoy, in any order."""
        rng = self.rng
        chosen = set(needed)
        if rng.random() < 0.3:
            chosen.add(rng.choice(("lookup_person", "calculator")))
        tools = [variant(t, rng) for t in (LOOKUP_PERSON, CALCULATOR) + DECOYS if t["function"]["name"] in chosen]
        if rng.random() < 0.1:
            decoy = variant(rng.choice(DECOYS), rng)
            if decoy["function"]["name"] not in chosen:
                tools.append(decoy)
        rng.shuffle(tools)
        return tools

    def earlier(self, turns: int) -> List[dict]:
        """``turns`` earlier exchanges: plain rows of the mix, or (one in three) a whole tool round trip."""
        out: List[dict] = []
        for _ in range(turns):
            if self.rng.random() < 0.25:
                out += self.task().messages("answer", self.rng, self.call_id())
            else:
                out += [dict(m) for m in self.rng.choice(self.untooled)["messages"][:2]]
        return out

    def with_system(self, row: dict) -> dict:
        """``row`` with a system message first, for a share ``systems`` of rows."""
        if self.system_rng.random() < self.systems:
            text = self.system_rng.choice(HELD_OUT_SYSTEMS if self.held_out else SYSTEMS)
            row["messages"] = [{"role": "system", "content": text}] + row["messages"]
        return row

    def other_call_task(self) -> ToolTask:
        """A question one of the DECOYS serves: its call, a result and the answer from it."""
        rng = self.rng
        place = rng.choice(HELD_OUT_PLACES if self.held_out else PLACES)
        topic = rng.choice(HELD_OUT_TOPICS if self.held_out else TOPICS)
        kind = rng.randrange(4)
        if kind == 0:
            sky, degrees = rng.choice(SKIES), rng.randint(-5, 35)
            result = rng.choice((f"{sky}, {degrees} C", json.dumps({"city": place, "sky": sky,
                                                                       "temperature_c": degrees})))
            return ToolTask(rng.choice(WEATHER_TEMPLATES).format(p=place), "get_weather", {"city": place}, result,
                            f"It is {sky} and {degrees} C in {place}.")
        if kind == 1:
            time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
            result = rng.choice((time, json.dumps({"timezone": place, "time": time})))
            return ToolTask(rng.choice(TIME_TEMPLATES).format(p=place), "get_time", {"timezone": place}, result,
                            f"It is {time} in {place}.")
        if kind == 2:
            found = rng.random() < 0.5
            result = f"One page: {topic}, a short guide." if found else rng.choice(("No results.", "[]"))
            answer = f"I found a short guide about {topic}." if found else f"I found nothing about {topic}."
            return ToolTask(rng.choice(SEARCH_TEMPLATES).format(t=topic), "search_web", {"query": topic}, result,
                            answer)
        name, note = rng.choice(self.names), rng.choice(NOTES)
        sent = rng.random() < 0.8
        result = rng.choice(("sent", json.dumps({"status": "sent"}))) if sent else "error: mailbox full"
        return ToolTask(rng.choice(EMAIL_TEMPLATES).format(n=name, b=note), "send_email", {"to": name, "body": note},
                        result, f"The email to {name} is sent." if sent else f"I could not send the email to {name}.")

    def partial_person_task(self) -> ToolTask:
        """``lookup_person`` answering with some of the facts (each kept at even odds: one in eight, all), or none
    ("not found"): the answer says what came."""
        rng = self.rng
        task = self.person_task()
        name = task.arguments["name"]
        facts = json.loads(task.result)
        template = PERSON_TEMPLATES.index(next(t for t in PERSON_TEMPLATES if t.format(n=name) == task.question))
        if rng.random() < 0.3:
            result = rng.choice((f"No person named {name}.", json.dumps({"error": "not found"}), "null"))
            return ToolTask(task.question, task.tool, task.arguments, result, f"I could not find {name}.")
        keep = [k for k in ("city", "job", "pet") if rng.random() < 0.5] or [rng.choice(("city", "job", "pet"))]
        shown = {"name": name, **{k: facts[k] for k in ("city", "job") if k in keep}}
        if "pet" in keep:
            shown.update(pet=facts["pet"], pet_name=facts["pet_name"])
        asked = ("city", "job", "pet") if template < 3 else (("pet", "job", "city")[template - 3],)
        said = [FIELD_SENTENCES[k].format(n=name, v=facts[k]) if k != "pet" else
                f"{name} has a {facts['pet']} named {facts['pet_name']}." for k in asked if k in keep]
        what = {"city": "where {n} lives", "job": "what {n} does", "pet": "about a pet of {n}"}
        answer = " ".join(said) if said else f"The lookup says nothing {what[asked[0]].format(n=name)}." \
            if asked[0] == "pet" else f"The lookup does not say {what[asked[0]].format(n=name)}."
        return ToolTask(task.question, task.tool, task.arguments, json.dumps(shown), answer)

    def other_row(self, upto: str, turns: int) -> dict:
        """A ``tool_other_call`` row (``upto`` "call": another tool's call) or a ``tool_other`` one (the answer
        from another tool's result, or from a lookup that found part of a person or none)."""
        task = self.other_call_task() if upto == "call" or self.rng.random() < 0.6 else self.partial_person_task()
        row = self.tool_row(upto, turns, task)
        row["family"] = "tool_other" + ("_call" if upto == "call" else "")
        return row

    def call_id(self) -> str:
        self.calls += 1
        return f"call_{self.calls}"

    def tool_row(self, upto: str, turns: int, task: Optional[ToolTask] = None) -> dict:
        task = task or self.task()
        while True:  # fewer earlier turns until the row is at most MAX_CHARS (about 800 tokens)
            earlier = self.earlier(turns)
            needed = {task.tool} | {c["function"]["name"] for m in earlier for c in m.get("tool_calls") or []}
            row = {"messages": earlier + task.messages(upto, self.rng, self.call_id()),
                   "tools": self.tools_for(sorted(needed)), "family": "tool_" + upto}
            if len(json.dumps(row)) <= MAX_CHARS or turns == 0:
                return self.with_system(row)
            turns -= 1

    def direct_row(self, turns: int) -> dict:
        """Tools offered, a question of the mix that none of them serves: its plain answer, no call.

        A question about a person is offered only the calculator; arithmetic
        (which the calculator serves) is left out."""
        from refusion_mlx.train.accuracy import family_of_prompt

        while True:
            row = self.rng.choice(self.plain)
            family = family_of_prompt(row["messages"][0]["content"])
            if family not in TOOLED[1:]:
                break
        offered = ("calculator",) if family == "people" else \
            self.rng.choice((("lookup_person",), ("calculator",), ("lookup_person", "calculator")))
        earlier = self.earlier(turns)
        needed = set(offered) | {c["function"]["name"] for m in earlier for c in m.get("tool_calls") or []}
        if family == "people" and "lookup_person" in needed:  # with lookup_person offered it would call it
            earlier, needed = [], set(offered)
        if len(json.dumps(earlier + row["messages"])) > MAX_CHARS - 400 * len(needed):
            earlier, needed = [], set(offered)
        tools = [variant(t, self.rng) for t in (LOOKUP_PERSON, CALCULATOR) if t["function"]["name"] in needed]
        self.rng.shuffle(tools)
        return self.with_system({"messages": earlier + [dict(m) for m in row["messages"][:2]], "tools": tools,
                                 "family": "tool_direct"})

    def json_row(self) -> dict:
        rng = self.rng
        while True:
            name, template = rng.choice(self.names), rng.randrange(len(JSON_TEMPLATES))
            if held_out_json(self.names, name, template) == self.held_out:
                return {"messages": [{"role": "user", "content": JSON_TEMPLATES[template].format(n=name)},
                                     {"role": "assistant", "content": facts_json(name, self.people[name])}],
                        "family": "json"}


def build(tasks: Path, out: Path, seed: int = 0, n_calls: int = 3000, n_answers: int = 3000,
          n_direct: int = 1500, n_json: int = 1500, n_valid: int = 200, systems: float = 0.0,
          made_up: float = 0.0, n_other: int = 0, n_other_calls: int = 0) -> dict:
    """Write ``train.jsonl`` and ``valid.jsonl`` of the tool and JSON rows into ``out``.

    Calls and answers: two in five alone, the rest after 1 or 2 earlier turns
    (plain rows of the mix, or whole tool round trips). ``valid.jsonl`` is
    drawn the same way from the held-out questions and the mix's validation rows.
    A share ``systems`` of the rows with tools start with a system message
    (``SYSTEMS``; held out: ``HELD_OUT_SYSTEMS``); a share ``made_up`` of the
    unknown people in training rows get made-up names (``made_up_name``).
    ``n_other`` ``tool_other`` rows and ``n_other_calls`` ``tool_other_call``
    rows are drawn after the others (none: the rows of earlier runs, as they were)."""
    train_rows, valid_rows = read_jsonl(tasks / "train.jsonl"), read_jsonl(tasks / "valid.jsonl")
    people = people_facts(train_rows)
    rng = random.Random(seed)

    def rows(builder: Builder, calls: int, answers: int, direct: int, json_rows: int, other: int,
             other_calls: int) -> List[dict]:
        def turns() -> int:
            return rng.choice((0, 0, 1, 1, 2))
        out_rows = [builder.tool_row("call", turns()) for _ in range(calls)]
        out_rows += [builder.tool_row("answer", turns()) for _ in range(answers)]
        out_rows += [builder.direct_row(turns()) for _ in range(direct)]
        out_rows += [builder.json_row() for _ in range(json_rows)]
        out_rows += [builder.other_row("answer", turns()) for _ in range(other)]
        out_rows += [builder.other_row("call", turns()) for _ in range(other_calls)]
        rng.shuffle(out_rows)
        return out_rows

    counts = (n_calls, n_answers, n_direct, n_json, n_other, n_other_calls)
    train = rows(Builder(people, train_rows, rng, held_out=False, systems=systems, system_seed=seed + 1,
                         made_up=made_up), *counts)
    share = n_valid / max(1, sum(counts))
    valid = rows(Builder(people, valid_rows, rng, held_out=True, systems=systems, system_seed=seed + 2),
                 *(round(n * share) for n in counts))
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "valid.jsonl", valid)
    return {"train": len(train), "valid": len(valid)}


def eval_files(tasks: Path, out: Path, seed: int = 0, n_arithmetic: int = 50, n_new: int = 25,
               n_direct: int = 100, n_other: int = 50) -> dict:
    """Held-out checks, written into ``out``:

    * ``tools_alone.jsonl``: every held-out question about a known person (25),
      ``n_new`` about people outside the 25 (held-out names), ``n_arithmetic``
      held-out operand pairs: the call, asked alone;
    * ``tools_later.jsonl``: the same questions as the second or third turn;
    * ``tool_answers.jsonl``: the same, with the call and its result: the answer;
    * ``tools_direct.jsonl``: validation rows of the mix with tools offered: the answer, no call;
    * ``json.jsonl``: every held-out JSON question (25);
    * ``tools_system.jsonl``: ``tools_alone``'s questions after a held-out system message;
    * ``tool_other.jsonl``: ``n_other`` round trips whose result is not a whole person (held-out
      places and topics, half as a later turn): the answer, no call;
    * ``tool_other_calls.jsonl``: ``n_other`` questions for the other tools: the call."""
    train_rows, valid_rows = read_jsonl(tasks / "train.jsonl"), read_jsonl(tasks / "valid.jsonl")
    people = people_facts(train_rows)
    rng = random.Random(seed)
    b = Builder(people, valid_rows, rng, held_out=True)
    tasks_: List[ToolTask] = []
    for name in b.names:
        template = next(t for t in range(len(PERSON_TEMPLATES)) if held_out_person(b.names, name, t))
        tasks_.append(ToolTask(PERSON_TEMPLATES[template].format(n=name), "lookup_person", {"name": name},
                               facts_json(name, people[name]), person_answer(template, name, people[name])))
    tasks_ += [b.person_task(known=False) for _ in range(n_new)]
    tasks_ += [b.arithmetic_task() for _ in range(n_arithmetic)]
    files = {
        "tools_alone": [b.tool_row("call", 0, t) for t in tasks_],
        "tools_later": [b.tool_row("call", rng.randint(1, 2), t) for t in tasks_],
        "tool_answers": [b.tool_row("answer", 0, t) for t in tasks_],
        "tools_direct": [b.direct_row(0) for _ in range(n_direct)],
        "json": [{"messages": [{"role": "user", "content": JSON_TEMPLATES[t].format(n=name)},
                               {"role": "assistant", "content": facts_json(name, people[name])}],
                  "family": "json"}
                 for name in b.names for t in range(len(JSON_TEMPLATES)) if held_out_json(b.names, name, t)],
    }
    files["tools_system"] = [dict(row, messages=[{"role": "system", "content": HELD_OUT_SYSTEMS[i % 3]}]
                                  + row["messages"]) for i, row in enumerate(files["tools_alone"])]
    # drawn last, from their own stream: the files above stay as earlier runs wrote them
    other = Builder(people, valid_rows, random.Random(seed + 1000), held_out=True)
    files["tool_other"] = [other.other_row("answer", i % 2) for i in range(n_other)]
    files["tool_other_calls"] = [other.other_row("call", 0) for _ in range(n_other)]
    out.mkdir(parents=True, exist_ok=True)
    for name, file_rows in files.items():
        write_jsonl(out / f"{name}.jsonl", file_rows)
    return {name: len(file_rows) for name, file_rows in files.items()}


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="../shared/fixtures/tiny-refusion-tasks",
                    help="the shared task mix (train.jsonl, valid.jsonl)")
    ap.add_argument("--out", default="tool_data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", type=float, default=0.0, help="share of rows with tools that start with a "
                                                                "system message (default 0)")
    ap.add_argument("--eval", action="store_true", help="write the held-out checks instead of training rows")
    ap.add_argument("--made-up-names", type=float, default=0.0,
                    help="share of unknown people in tool rows whose names are made up (default 0: the 30 "
                         "NEW_NAMES only)")
    counts = (("calls", 3000, "rows that end in a call"), ("answers", 3000, "rows that end in the answer from a "
              "tool's result"), ("direct", 1500, "rows whose tools do not serve the question"),
              ("json-rows", 1500, "rows of the JSON family"),
              ("other", 0, "rows that end in the answer from a result of another shape or tool"),
              ("other-calls", 0, "rows that end in a call of one of the other tools"))
    for flag, default, what in counts:
        ap.add_argument(f"--{flag}", type=int, default=default, help=f"{what} (default {default})")
    args = ap.parse_args()
    for flag, _, _ in counts:
        if getattr(args, flag.replace("-", "_")) < 0:
            ap.error(f"--{flag} must be 0 or more")
    if args.eval:
        print(eval_files(Path(args.tasks), Path(args.out), args.seed))
    else:
        print(build(Path(args.tasks), Path(args.out), args.seed, args.calls, args.answers, args.direct,
                    args.json_rows, systems=args.systems, made_up=args.made_up_names, n_other=args.other,
                    n_other_calls=args.other_calls))


if __name__ == "__main__":
    main()
