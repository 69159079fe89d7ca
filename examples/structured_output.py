"""Structured output: answers decoded under a JSON Schema (docs/constrained.md).

    python examples/structured_output.py [--model PATH] [--max-tokens 160]

Asks the model about a few people, each answer constrained to a person's
facts as a JSON object, several at once in one batch; every answer that
finishes "stop" parses and validates (the grammar's guarantee, whatever the
model), and one cut by the budget says "length". The values are the model's:
the bundled demo model was trained on this family (its people's facts as
JSON, examples/demo_model/tool_data.py), so it writes them, mostly right.
"""

from __future__ import annotations

import argparse
import json
import sys

import refusion_mlx as rm

PERSON = {  # the demo's JSON family (examples/demo_model/tool_data.py), with tighter values
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "city": {"type": "string", "maxLength": 16},
        "job": {"type": "string", "maxLength": 16},
        "pet": {"enum": ["cat", "dog", "goat", "hamster", "parrot", "rabbit", "turtle"]},
        "pet_name": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "city", "job", "pet", "pet_name"],
    "additionalProperties": False,
}
PEOPLE = ["Sven", "Dara", "Quinn", "Zoe"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    model, tokenizer = rm.load(args.model)
    prompts = [rm.chat_prompt(tokenizer, f"Give {who}'s facts as JSON.") for who in PEOPLE]
    results = rm.batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens,
                                constraints=[rm.Constraint.json_schema(PERSON)] * len(prompts))
    for who, r in zip(PEOPLE, results):
        if r.finish_reason == "stop":
            print(f"{who}: {json.dumps(json.loads(r.text))}")
        else:
            print(f"{who}: ({r.finish_reason}) {r.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
