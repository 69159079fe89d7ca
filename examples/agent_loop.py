"""An agent loop against ``python -m refusion_mlx.server``: the model calls
tools, this script runs them and sends the results back, until the model
answers in text.

    python -m refusion_mlx.server &            # the demo model, on http://127.0.0.1:8080/v1
    python examples/agent_loop.py "What pet does Zoe have?"
    python examples/agent_loop.py --api responses "What is 29 * 3?"

Two tools: ``lookup_person`` (facts about a person as a JSON object, from
the table below or a JSON file of ``{"name": {"city": ...}}``, ``--people``) and
``calculator`` (arithmetic, evaluated here without ``eval``). It works with
any model the server serves whose chat template renders tools (the server
answers 400 "this model's chat template has no tool-call format" otherwise):
``--api chat`` sends the whole conversation each turn to
``/v1/chat/completions`` (the prompt cache continues it), ``--api responses``
sends only the tool results with ``previous_response_id``. The demo model
was trained on these two tools (``examples/demo_model/tool_data.py``): it
looks people up (those it knows and others: try ``--people`` with new
names) and sends arithmetic to the calculator, then answers from the result.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys
from pathlib import Path

import openai

PEOPLE = {  # two of the demo model's fictional people
    "Sven": {"city": "Hanoi", "job": "baker", "pet": "turtle", "pet_name": "Pepper"},
    "Zoe": {"city": "Bern", "job": "tailor", "pet": "hamster", "pet_name": "Max"},
}
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_person", "description": "Facts about a person, by first name.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "The value of an arithmetic expression (+, -, *, /, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")
    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else result)


def run_tool(name: str, arguments: str, people: dict) -> str:
    """A call's result as text (an error is a result too: the model reads it)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: the arguments are not JSON"
    if name == "lookup_person":
        who = str(args.get("name", "")).strip()
        if who not in people:
            return f"error: nobody named {who!r}"
        facts = people[who]
        return json.dumps({"name": who, **facts}) if isinstance(facts, dict) else str(facts)
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    return f"error: no tool named {name!r}"


def chat_loop(client, model: str, question: str, people: dict, turns: int) -> str:
    messages = [{"role": "user", "content": question}]
    for _ in range(turns):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments, people)
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "(no answer after --turns turns)"


def responses_loop(client, model: str, question: str, people: dict, turns: int) -> str:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = client.responses.create(model=model, input=question, tools=tools)
    for _ in range(turns):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        results = []
        for call in calls:
            result = run_tool(call.name, call.arguments, people)
            print(f"  {call.name}({call.arguments}) -> {result}")
            results.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
        response = client.responses.create(model=model, input=results, tools=tools,
                                           previous_response_id=response.id)
    return "(no answer after --turns turns)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What pet does Zoe have?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--api", choices=("chat", "responses"), default="chat")
    parser.add_argument("--people", type=Path,
                        help='a JSON file {"name": {"city": ..., "job": ..., "pet": ..., "pet_name": ...}} '
                             'for lookup_person')
    parser.add_argument("--turns", type=int, default=4, help="most model calls (default 4)")
    args = parser.parse_args()
    people = json.loads(args.people.read_text()) if args.people else PEOPLE
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("REFUSION_MLX_API_KEY", "not-needed"), max_retries=0, timeout=120)
    try:
        model = client.models.list().data[0].id
        loop = chat_loop if args.api == "chat" else responses_loop
        print(f"{model}> {loop(client, model, args.question, people, args.turns)}")
    except openai.APIConnectionError:
        print(f"error: no server at {args.base_url}; start one with python -m refusion_mlx.server", file=sys.stderr)
        return 1
    except openai.APIStatusError as e:
        print(f"error: {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
