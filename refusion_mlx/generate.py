"""Generate with ReFusion: Python API and ``python -m refusion_mlx.generate``.

Slots finish out of order, but text is only ever released in answer order:
each response carries the text that just became final (the contiguous prefix
of the answer grew) and the slots committed at that step, for visualisers.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Union

from .cache import CommittedCache
from .decoder import DecodeStats, RefusionDecoder, RefusionParams, SlotCommit
from .errors import DecodeError, RefusionError
from .presets import PRESETS, preset

DEFAULT_PROMPT = "Write the multiplication table of 7 up to 5."

PARAM_NAMES = ("gen_length", "slot_size", "serial_num_blocks", "block_length",
               "slot_threshold", "token_threshold", "temperature", "seed")


@dataclass
class GenerationResponse:
    """One step of a streamed generation.

    ``text``/``tokens``: what just became final, in answer order (may be
    empty when the step committed slots beyond a gap). ``commits``: the slots
    committed at this step, in commit order. The last response has
    ``finish_reason`` ("stop": EOS; "length": budget spent) and ``stats``.
    """

    text: str
    tokens: List[int]
    commits: List[SlotCommit]
    phase: str
    step: int
    prompt_tokens: int
    generation_tokens: int
    finish_reason: Optional[str] = None
    stats: Optional[DecodeStats] = None


def make_params(**kwargs) -> RefusionParams:
    """RefusionParams from keyword arguments; ``max_tokens``/``temp`` are aliases."""
    if "max_tokens" in kwargs:
        value = kwargs.pop("max_tokens")
        if "gen_length" in kwargs and kwargs["gen_length"] != value:
            raise DecodeError("give max_tokens or gen_length, not both")
        kwargs["gen_length"] = value
    if "temp" in kwargs:
        kwargs["temperature"] = kwargs.pop("temp")
    unknown = sorted(set(kwargs) - set(PARAM_NAMES))
    if unknown:
        raise TypeError(f"unknown decoding parameter(s): {', '.join(unknown)}")
    return RefusionParams(**{k: v for k, v in kwargs.items() if v is not None})


def chat_prompt(tokenizer, prompt: Union[str, List[Dict[str, str]]], system: Optional[str] = None,
                chat_template: bool = True) -> List[int]:
    """Prompt ids as the reference builds them: chat template, then tokenize."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False, enable_thinking=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))


class AnswerText:
    """Releases the answer's text in order, only once it can no longer change."""

    def __init__(self, tokenizer, response_start: int, eos_id: int):
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.next = response_start
        self.eos_id = eos_id
        self.pending: Dict[int, int] = {}
        self.tokens: List[int] = []
        self.text = ""
        self.done = False

    def add(self, commits: Sequence[SlotCommit]) -> tuple:
        """Take a step's commits; return (newly final ids, newly final text)."""
        for c in commits:
            self.pending.update(zip(c.positions, c.tokens))
        new = []
        while not self.done and self.next in self.pending:
            tok = self.pending.pop(self.next)
            new.append(tok)
            self.next += 1
            self.done = tok == self.eos_id
        if not new:
            return new, ""  # nothing became final: no decode this step
        self.tokens += new
        return new, self._release(final=self.done)

    def _release(self, final: bool) -> str:
        ids = [t for t in self.tokens if t < self.vocab and t != self.eos_id]
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not final:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 sequence may still grow
        if not full.startswith(self.text):
            return ""  # a decode that rewrote earlier text: hold until it settles
        segment, self.text = full[len(self.text):], full
        return segment

    def finish(self) -> str:
        return self._release(final=True)


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], *,
                    cache: Optional[CommittedCache] = None, params: Optional[RefusionParams] = None,
                    **kwargs) -> Iterator[GenerationResponse]:
    """Decode ``prompt`` (text, tokenized as is, or ids) with ReFusion, streaming.

    Decoding parameters come as ``params`` or as keywords: ``max_tokens``
    (= ``gen_length``), ``slot_size``, ``serial_num_blocks`` or
    ``block_length``, ``slot_threshold``, ``token_threshold``, ``temperature``
    (= ``temp``), ``seed``. ``cache``: a CommittedCache to continue (chat).
    """
    if params is not None and kwargs:
        raise TypeError("give params or decoding keywords, not both")
    rp = params or make_params(**kwargs)
    ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
    mask_id = getattr(model.args, "mask_token_id", None)
    if mask_id is None:
        raise DecodeError("the model has no mask_token_id; load it with refusion_mlx.load")
    decoder = RefusionDecoder(model, ids, rp, mask_id=mask_id, eos_id=tokenizer.eos_token_id,
                              cache=cache)
    answer = AnswerText(tokenizer, decoder.response_start, decoder.eos_id)
    held: Optional[GenerationResponse] = None
    for n, step in enumerate(decoder.steps()):
        tokens, text = answer.add(step.commits)
        if held is not None:
            yield held
        held = GenerationResponse(text, tokens, step.commits, step.phase, n, len(ids),
                                  len(answer.tokens))
    held.text += answer.finish()
    held.finish_reason = "stop" if answer.done else "length"
    held.stats = decoder.stats
    held.generation_tokens = len(answer.tokens)
    yield held


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], verbose: bool = False,
             return_stats: bool = False, **params):
    """The whole answer's text (and its DecodeStats if ``return_stats``)."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, **params):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose:
        print()
        print(format_stats(last.stats), file=sys.stderr)
    return (text, last.stats) if return_stats else text


def format_stats(stats: DecodeStats) -> str:
    s = stats.seconds
    return (
        f"prompt: {stats.prompt_tokens} tokens | generated: {stats.generated_tokens} tokens, "
        f"{stats.forwards} forwards, {stats.tokens_per_forward:.2f} tokens/forward, "
        f"{stats.tokens_per_second:.1f} tokens/s\n"
        f"time: prefill {s['prefill']:.3f}s, plan {s['plan']:.3f}s, verify {s['verify']:.3f}s, "
        f"infill draft {s['infill_draft']:.3f}s, infill verify {s['infill_verify']:.3f}s | "
        f"peak memory {stats.peak_memory_gb:.3f} GB"
    )


# --------------------------------------------------------------------------
# CLI


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """The ReFusion decoding flags, shared by generate, chat and bench."""
    parser.add_argument("--max-tokens", "--gen-length", dest="gen_length", type=int,
                        help="response budget in tokens, rounded up to whole slots (default 512)")
    parser.add_argument("--slot-size", type=int, help="tokens per slot (default 4)")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--serial-num-blocks", type=int,
                        help="number of blocks decoded one after another (reference semantics)")
    blocks.add_argument("--block-length", type=int, help="block size in tokens (a multiple of the slot size)")
    parser.add_argument("--slot-threshold", type=float, help="slot confidence to draft in parallel (default 0.6)")
    parser.add_argument("--token-threshold", type=float, help="verified probability to keep a token (default 0.3)")
    parser.add_argument("--temp", dest="temperature", type=float, help="planning temperature (default 0: argmax)")
    parser.add_argument("--seed", type=int, help="random seed for temperature > 0")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="the paper's per-benchmark settings (explicit flags override)")


def params_from_args(args: argparse.Namespace) -> RefusionParams:
    """RefusionParams from CLI flags: a preset first, explicit flags over it.

    A preset's block count is tied to its 512-token budget; with another
    budget the preset keeps its block *length* instead.
    """
    values = preset(args.preset) if getattr(args, "preset", None) else {}
    if values and (args.block_length is not None or args.gen_length is not None):
        n = values.pop("serial_num_blocks")
        if args.block_length is None and args.serial_num_blocks is None:
            values["block_length"] = values["gen_length"] // n
    for name in PARAM_NAMES:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    params = make_params(**values)
    params.layout()  # report bad combinations before loading the model
    return params


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m refusion_mlx.generate",
                           description="Generate text with a ReFusion model (slot-level plan-and-infill decoding).")
    parser.add_argument("--model", help="model folder or hub repo id (default: the bundled demo model)")
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt; '-' reads standard input")
    parser.add_argument("--system", help="system message")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompt as is")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="compute dtype (default: float32 on CPU, the checkpoint's on GPU)")
    add_decoding_args(parser)
    parser.add_argument("--verbose", action="store_true", help="print statistics to standard error")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, output_ids, statistics) instead of streaming")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        params = params_from_args(args)
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        from .utils import load

        model, tokenizer = load(args.model, dtype=args.dtype)
        ids = chat_prompt(tokenizer, prompt, system=args.system, chat_template=not args.no_chat_template)
        text, tokens, last = "", [], None
        for last in stream_generate(model, tokenizer, ids, params=params):
            text += last.text
            tokens += last.tokens
            if not args.json:
                print(last.text, end="", flush=True)
        if args.json:
            print(json.dumps({"text": text, "output_ids": tokens, "prompt_ids": ids,
                              "finish_reason": last.finish_reason, "stats": last.stats.as_dict()}))
        else:
            print()
        if args.verbose:
            print(format_stats(last.stats), file=sys.stderr)
        return 0
    except RefusionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


class _CallableModule(types.ModuleType):
    """``refusion_mlx.generate`` is both this module and the function above:
    importing the submodule rebinds the package attribute to the module, so
    the module forwards calls to the function (``rm.generate(...)`` works
    either way, as ``mlx_lm.generate`` does)."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
