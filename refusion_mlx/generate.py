"""``python -m refusion_mlx.generate``: decode one prompt from the command line.

A thin layer over :mod:`refusion_mlx.decode.stream`. ``refusion_mlx.generate``
is also callable as the function ``generate`` (as ``mlx_lm.generate`` is).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ._blas import describe as blas_description
from ._callable import make_callable
from .cli import (OneLineParser, add_decoding_args, add_kv_args, add_model_args, add_template_arg, fill_defaults,
                  fitted, params_from_args, positive_int, read_input, read_text, refuse_unread, run, Spelled, spelled,
                  storage_from_args, without_line_end)
from .cli.launch import add_distributed_args, join, ready, with_distributed
from .cli.mlx_lm_flags import add_end_tokens, add_mlx_lm_args, add_verbose_arg
from .decode.answer import AnswerText
from .decode.batch import BatchResult, stream_batch
from .decode.grammar import Constraint
from .decode.params import PARAM_NAMES, make_params
from .decode.prompts_file import parse_prompts
from .decode.stream import GenerationResponse, chat_prompt, format_stats, generate, stream_generate
from .distributed import watchdog
from .errors import RefusionError
from .models.backend import wired_limit
from .models.loading import load

# the names this module offered before the package was split by concern
__all__ = ["AnswerText", "GenerationResponse", "PARAM_NAMES", "build_parser", "chat_prompt", "format_stats",
           "generate", "main", "make_params", "stream_generate"]

DEFAULT_PROMPT = "Write the multiplication table of 7 up to 5."
GOES_WITH = {"prompts_file": ("batch_size",)}  # refused without it: it would be ignored (cli.unread)
DEFAULTS = {"batch_size": 8}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m refusion_mlx.generate",
                           description="Generate text with a ReFusion model (slot-level plan-and-infill decoding).")
    add_model_args(parser, short=False)  # -m: --max-tokens, as mlx-lm's
    add_distributed_args(parser)
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt; '-' reads standard input")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="many prompts decoded in batches: one per line, or JSONL objects with 'prompt' "
                              "and optional per-prompt settings ('-' reads standard input)")
    parser.add_argument("--system", "--system-prompt", dest="system", action=Spelled, help="system message")
    parser.add_argument("--no-chat-template", "--ignore-chat-template", dest="no_chat_template", action=Spelled,
                        nargs=0, default=False, help="tokenize the prompt as is")
    add_template_arg(parser)
    add_decoding_args(parser, max_tokens_short=True)
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE|JSON",
                       help="constrained decoding: the answer is JSON valid under this JSON Schema (a file, or the "
                            "schema itself as JSON text); ends 'length' if the budget ends first")
    shape.add_argument("--grammar", metavar="FILE",
                       help="constrained decoding: the answer matches this grammar (llguidance's Lark format)")
    add_kv_args(parser)
    parser.add_argument("--batch-size", type=positive_int,
                        help=f"with --prompts-file: requests decoded together (default {DEFAULTS['batch_size']})")
    add_verbose_arg(parser, "print statistics to standard error")
    add_mlx_lm_args(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, output_ids, prompt_ids, finish_reason, stats) instead "
                             "of streaming; with --prompts-file one a line, with index and error too")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_unread(parser, args, GOES_WITH)
    fill_defaults(args, DEFAULTS)
    for needs in ("system", "chat_template_config", "chat_template"):  # mlx-lm drops the system prompt there
        if args.no_chat_template and getattr(args, needs) is not None:
            parser.error(f"{spelled(args, needs)} needs the chat template: {spelled(args, 'no_chat_template')} "
                         "tokenizes the prompt as is")

    def body() -> int:
        params = params_from_args(args)
        storage = storage_from_args(args)  # a bad --kv-bits / --kv-group-size pair fails before the model loads
        constraint = constraint_from_args(args)
        dist = join(args)  # under mlx.launch: this rank's group; only rank 0 prints
        if dist is not None and "-" in (args.prompt, args.prompts_file):
            raise RefusionError("under mlx.launch standard input never ends (the launcher does not pass "
                                "its end on): give --prompt TEXT or --prompts-file FILE")
        if args.prompts_file is not None:
            return run_prompts_file(args, params, dist, constraint, storage)
        # stdin's last newline (echo's, a file's, Windows' \r\n) is not part of the prompt
        # as mlx-lm's: "\n" and "\t" typed in --prompt are a newline and a tab
        prompt = (without_line_end(read_input("-", "--prompt")) if args.prompt == "-"
                  else args.prompt.replace("\\n", "\n").replace("\\t", "\t"))
        model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path, dist=dist,
                                chat_template=args.chat_template)
        storage = storage_from_args(args, model)  # the group size against the model's head dimension
        add_end_tokens(tokenizer, model, args.extra_eos_token)
        ready(dist)
        ids = chat_prompt(tokenizer, prompt, system=args.system, chat_template=not args.no_chat_template,
                          template_kwargs=args.chat_template_config)
        params = fitted(params, len(ids), model, args.gen_length)  # the default shrunk to what the context leaves
        text, tokens, last = "", [], None
        with watchdog.armed():
            try:
                for last in stream_generate(model, tokenizer, ids, params=params, storage=storage, **constraint):
                    text += last.text
                    tokens += last.tokens
                    if not args.json:
                        print(last.text, end="", flush=True)
            except KeyboardInterrupt:  # a partial answer's line ended before "interrupted" (cli.run)
                if text and not args.json and not text.endswith("\n"):
                    print(flush=True)
                raise
        if args.json:
            print(json.dumps({"text": text, "output_ids": tokens, "prompt_ids": ids,
                              "finish_reason": last.finish_reason,
                              "stats": with_distributed(last.stats.as_dict(), dist)}), flush=True)
        else:  # the answer's line ended and written before any statistics on stderr (a log of both)
            print(flush=True)
        if args.verbose:
            print(format_stats(last.stats), file=sys.stderr)
            print(f"BLAS: {blas_description()}", file=sys.stderr)
        return 0

    with wired_limit():  # Metal: the weights stay resident while the command decodes
        return run(body)


def constraint_from_args(args) -> dict:
    """``--json-schema`` (a file or JSON text) or ``--grammar`` (a file) as
    ``stream_generate``'s keywords, checked before the model loads: the
    Constraint itself (``grammar=`` takes one made already), so what is
    found when it is compiled is said of the flag too."""
    if args.json_schema is not None:
        text = args.json_schema if _is_json(args.json_schema) else read_text(args.json_schema)
        return {"grammar": Constraint.json_schema(text, "--json-schema")}
    if args.grammar is not None:
        return {"grammar": Constraint.lark(read_text(args.grammar), "--grammar")}
    return {}


def _is_json(text: str) -> bool:
    """Whether ``--json-schema``'s value is JSON text (``true`` is a schema too), not a file's name."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return text.lstrip().startswith("{")  # an object that does not parse: said so as one, not as a file
    return True


def run_prompts_file(args, params, dist=None, constraint=None, storage=None) -> int:
    """Decode every prompt of ``--prompts-file`` in batches; print each
    answer (or one JSON object per line with ``--json``) in file order, as
    soon as it and every answer before it are done (Ctrl-C keeps what was
    printed; a JSONL reader reads them as they come).
    Exit status 1 if any prompt failed alone (the others are still printed)."""
    text = read_input(args.prompts_file, "--prompts-file")
    system_flag = spelled(args, "system") if args.system is not None else "--system"
    items = parse_prompts(text, args.prompts_file, params, args.system, system_flag)  # each line checked
    model, tokenizer = load(args.model, dtype=args.dtype, adapter_path=args.adapter_path, dist=dist,
                            chat_template=args.chat_template)
    storage = storage_from_args(args, model)  # the group size against the model's head dimension
    add_end_tokens(tokenizer, model, args.extra_eos_token)
    ready(dist)
    ids = [chat_prompt(tokenizer, it.prompt, system=args.system, chat_template=not args.no_chat_template,
                       template_kwargs=args.chat_template_config) for it in items]
    params = [fitted_or_as_is(it, len(p), model, args.gen_length, f"[{i}] ")
              for i, (it, p) in enumerate(zip(items, ids))]
    results = [BatchResult(prompt_ids=p) for p in ids]
    printed = 0
    with watchdog.armed():
        one = (constraint or {}).get("grammar")
        for i, response in stream_batch(model, tokenizer, ids, params, max_batch=args.batch_size,
                                        constraints=[one] * len(ids), storage=storage):
            if results[i].add(response):
                while printed < len(results) and results[printed].finish_reason is not None:
                    print_result(args, printed, results[printed], dist)
                    printed += 1
    failed = [i for i, r in enumerate(results) if r.error is not None]
    if failed:
        print(f"error: {len(failed)} of {len(results)} prompts failed (first: [{failed[0]}] "
              f"{results[failed[0]].error})", file=sys.stderr)
        return 1
    return 0


def print_result(args, i: int, r: BatchResult, dist=None) -> None:
    """A prompts file's ``i``-th answer on standard output (its statistics on standard error with --verbose)."""
    if args.json:
        print(json.dumps({"index": i, "text": r.text, "output_ids": r.output_ids, "prompt_ids": r.prompt_ids,
                          "finish_reason": r.finish_reason, "error": r.error,
                          "stats": with_distributed(r.stats.as_dict() if r.stats else None, dist)}), flush=True)
    elif r.error is not None:
        print(f"[{i}] error: {r.error}", flush=True)
    else:
        print(f"[{i}] {r.text}", flush=True)
    if args.verbose and r.stats is not None:
        print(f"[{i}] {format_stats(r.stats)}", file=sys.stderr)


def fitted_or_as_is(item, prompt_tokens: int, model, given: Optional[int], where: str):
    """A prompts file's item's settings fitted to the context (:func:`fitted`; its line's ``max_tokens`` is
    the one given, else the command line's); one whose prompt leaves no room is left as it is, to fail alone."""
    asked = item.max_tokens if item.max_tokens is not None else given
    try:
        return fitted(item.params, prompt_tokens, model, asked, "max_tokens" if item.max_tokens else "--max-tokens",
                      where)
    except RefusionError:
        return item.params


make_callable(__name__, generate)

if __name__ == "__main__":
    sys.exit(main())
