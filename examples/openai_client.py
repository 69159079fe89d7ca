"""Talk to ``python -m refusion_mlx.server`` with the official ``openai`` client.

    python -m refusion_mlx.server &            # serves on http://127.0.0.1:8080/v1
    python examples/openai_client.py [--base-url http://127.0.0.1:8080/v1]

Streaming chunks carry only text that is final, in answer order. ReFusion's
own settings go in ``extra_body``. A server started with ``--api-key`` takes
the key from ``REFUSION_MLX_API_KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import openai


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("REFUSION_MLX_API_KEY", "not-needed"), max_retries=0, timeout=120)
    try:
        model = client.models.list().data[0].id
    except openai.APIConnectionError:
        print(f"error: no server at {args.base_url}; start one with python -m refusion_mlx.server",
              file=sys.stderr)
        return 1
    print(f"model: {model}")

    # 1. Streaming chat: print each piece of final text as it arrives.
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count from 17 to 38."}],
        max_tokens=96, stream=True, stream_options={"include_usage": True})
    print("stream> ", end="")
    first = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.choices and chunk.choices[0].finish_reason:
            print(f"\n  [finish_reason={chunk.choices[0].finish_reason}, first text after {first:.3f}s]")
        if chunk.usage:
            print(f"  [usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
                  f"completion tokens, {time.perf_counter() - t0:.3f}s]")

    # 2. One response, with ReFusion's decoding settings as extra body fields.
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Who is Sven?"}],
        max_tokens=64, temperature=0, stop=["Pepper"],
        extra_body={"slot_size": 4, "block_length": 32, "slot_threshold": 0.6, "token_threshold": 0.3})
    print(f"chat> {reply.choices[0].message.content}  [finish_reason={reply.choices[0].finish_reason}]")

    # 3. A text completion: the prompt is used as is (here written in the chat format by hand).
    prompt = ("<|im_start|>user\nWrite a Python function g that multiplies x by 4.<|im_end|>\n"
              "<|im_start|>assistant\n")
    done = client.completions.create(model=model, prompt=prompt, max_tokens=24)
    print(f"completion> {done.choices[0].text!r}")

    # 4. Bad requests come back as 4xx with an OpenAI error object.
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    except openai.BadRequestError as e:
        print(f"bad request> {e.status_code}: {e.body['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
