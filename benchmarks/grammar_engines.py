"""Grammar engines compared: mask time per token, compile time, JSON Schema coverage.

Which engine constrains ReFusion's slots was chosen with this script
(docs/benchmarks.md, "Grammar engines"). For each engine installed --
llguidance, xgrammar, outlines-core -- and each vocabulary (the demo model's 816
tokens, and a byte-level BPE of 151,671 tokens: the real checkpoint's size,
``--shape refusion-8b``), it compiles a set of JSON Schemas and walks a valid
instance of each token by token: the time to compute the allowed-token mask
before every token (the host's work per committed token), then the token
consumed. Coverage: whether each schema compiles, its valid instance is
accepted, and an invalid one is refused.

    python -m benchmarks.grammar_engines                       # both vocabularies
    python -m benchmarks.grammar_engines --vocab demo --json grammar.json

There is no real Qwen3 tokenizer offline, so the large vocabulary is a
byte-level BPE trained here with the ``tokenizers`` library on the Python
sources installed on the machine (Qwen2's pre-tokenizer regex, 151,643
merged tokens plus 28 special tokens, as Qwen3's tokenizer plus ReFusion's
two), cached under ``--cache`` (about 5 minutes to build on two cores).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from refusion_mlx.bench.report import format_table
from refusion_mlx.cli import OneLineParser, positive_int, run

REAL_VOCAB = 151_671
SPECIALS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
             "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
             "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
             "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
             "<|beginoftext|>", "<|mask|>"])
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# (name, schema, a valid instance, an invalid instance the schema refuses)
SCHEMAS: List[Tuple[str, dict, object, object]] = [
    ("person (flat, required)", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "city": {"type": "string"}},
        "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "city": "London"}, {"name": "Ada"}),
    ("nested objects", {
        "type": "object", "properties": {
            "id": {"type": "integer"},
            "owner": {"type": "object", "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                             "zip": {"type": "string"}},
                            "required": ["street", "zip"], "additionalProperties": False}},
                "required": ["name", "address"], "additionalProperties": False}},
        "required": ["id", "owner"], "additionalProperties": False},
     {"id": 7, "owner": {"name": "Grace Hopper", "address": {"street": "1 Navy Way", "zip": "20001"}}},
     {"id": 7, "owner": {"name": "Grace"}}),
    ("arrays (min/max items)", {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                  "minItems": 1, "maxItems": 4},
                                         "scores": {"type": "array", "items": {"type": "number"}}},
        "required": ["tags", "scores"], "additionalProperties": False},
     {"tags": ["red", "green"], "scores": [1.5, -2, 3e4]}, {"tags": [], "scores": []}),
    ("enum + const", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "kind": {"const": "paint"}},
        "required": ["color", "kind"], "additionalProperties": False},
     {"color": "green", "kind": "paint"}, {"color": "pink", "kind": "paint"}),
    ("numbers (bounds)", {
        "type": "object", "properties": {"pct": {"type": "number", "minimum": 0, "maximum": 100},
                                         "n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["pct", "n"], "additionalProperties": False},
     {"pct": 42.5, "n": 3}, {"pct": 42.5, "n": 12}),
    ("optional fields", {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"},
                                         "c": {"type": "null"}},
        "required": ["a"], "additionalProperties": False},
     {"a": "x", "c": None}, {"b": True}),
    ("string pattern", {
        "type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                         "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["date", "code"], "additionalProperties": False},
     {"date": "2024-05-17", "code": "ABC"}, {"date": "May 17", "code": "ABC"}),
    ("string length", {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["s"], "additionalProperties": False},
     {"s": "abcd"}, {"s": "abcdefgh"}),
    ("anyOf + $defs/$ref", {
        "$defs": {"pet": {"type": "object", "properties": {"name": {"type": "string"},
                                                           "legs": {"type": "integer"}},
                          "required": ["name"], "additionalProperties": False}},
        "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}},
                                         "id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["pets", "id"], "additionalProperties": False},
     {"pets": [{"name": "Rex", "legs": 4}, {"name": "Tweety"}], "id": "a1"}, {"pets": [{"legs": 4}], "id": 1}),
    ("tool call arguments", {
        "type": "object", "properties": {"location": {"type": "string", "description": "City"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit"], "additionalProperties": False},
     {"location": "Paris, France", "unit": "celsius", "days": 3}, {"location": "Paris", "unit": "kelvin"}),
    ("json_object (any JSON object)", {"type": "object"},
     {"name": "x", "list": [1, 2, {"deep": [True, None]}], "n": -0.5}, [1, 2]),
]


def build_vocabulary(cache: Path) -> Path:
    """A byte-level BPE tokenizer of REAL_VOCAB tokens (Qwen3's layout),
    trained on the Python sources installed here; cached at ``cache``."""
    if cache.exists():
        return cache
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    roots = sorted({p for p in sys.path if p.endswith(("site-packages", "python3.11", "python3.12", "python3.13"))})
    files = [f for r in roots for f in sorted(glob.glob(os.path.join(r, "**", "*.py"), recursive=True))]
    print(f"building a {REAL_VOCAB}-token byte-level BPE from {len(files)} Python files (cached at {cache}) ...",
          flush=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=REAL_VOCAB - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for f in files:
            try:
                yield Path(f).read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue

    tok.train_from_iterator(texts(), trainer)
    if tok.get_vocab_size() != REAL_VOCAB - len(SPECIALS):
        raise SystemExit(f"error: the corpus gave {tok.get_vocab_size()} tokens, not {REAL_VOCAB - len(SPECIALS)}")
    tok.add_special_tokens(SPECIALS)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(cache))
    return cache


def hf_tokenizer(path: Path):
    """A transformers fast tokenizer over a tokenizer.json (eos: ``<|im_end|>``)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def token_bytes(hf) -> List[bytes]:
    """Each token id's bytes (byte-level BPE; special tokens as their text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decode = {c: b for b, c in bytes_to_unicode().items()}
    out = [b""] * len(hf)
    special = set(hf.all_special_tokens) | set(hf.added_tokens_encoder)
    for text, i in hf.get_vocab().items():
        out[i] = text.encode() if text in special else bytes(decode[c] for c in text)
    return out


# -- the engines: compile(schema) -> matcher; mask(matcher) -> fills a buffer; consume(matcher, token) -> ok


class Llguidance:
    name = "llguidance"

    def __init__(self, hf, n_vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp

        self.ll, self.lnp = llguidance, lnp
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab)
        self.buf = lnp.allocate_token_bitmask(1, n_vocab)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        is_error, messages = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise ValueError(messages[0])
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m):
        self.lnp.fill_next_token_bitmask(m, self.buf, 0)

    def allowed(self, m, token: int) -> bool:
        return bool((self.buf[0, token // 32] >> (token % 32)) & 1)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def accepting(self, m) -> bool:
        return m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf, n_vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab)
        self.stops = list(info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.buf = xgr.allocate_token_bitmask(1, n_vocab)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m):
        m.fill_next_token_bitmask(self.buf)

    def allowed(self, m, token: int) -> bool:
        return bool((int(self.buf[0, token // 32]) >> (token % 32)) & 1)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def accepting(self, m) -> bool:
        m.fill_next_token_bitmask(self.buf)
        return any(self.allowed(m, t) for t in self.stops)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf, n_vocab: int):
        import outlines_core

        self.oc = outlines_core
        eos = hf.eos_token_id
        table: Dict[bytes, List[int]] = {}
        special = set(hf.all_special_ids)
        for i, b in enumerate(token_bytes(hf)):
            if i != eos and i not in special and b:
                table.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, table)
        self.buf = np.zeros(((n_vocab + 31) // 32,), dtype=np.int32)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, m):
        self.allowed_now = set(m.get_tokens())

    def allowed(self, m, token: int) -> bool:
        return token in self.allowed_now

    def consume(self, m, token: int) -> bool:
        m.advance(token)
        return True

    def accepting(self, m) -> bool:
        return m.is_finished()


ENGINES: Dict[str, Callable] = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def walk(engine, matcher, tokens: List[int]) -> Tuple[bool, List[float]]:
    """Mask before every token (timed), then consume it; whether every token was allowed."""
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        engine.mask(matcher)
        times.append(time.perf_counter() - t0)
        if not engine.allowed(matcher, t) or not engine.consume(matcher, t):
            return False, times
    return True, times


def measure(engine, hf, schemas) -> dict:
    """Compile, walk the valid instance, try the invalid one, per schema."""
    rows = []
    for name, schema, good, bad in schemas:
        row = {"schema": name}
        t0 = time.perf_counter()
        try:
            matcher = engine.compile(schema)
        except Exception as e:  # the engine refuses the schema: a coverage miss
            row.update(compiles=False, error=" ".join(str(e).split())[:120])
            rows.append(row)
            continue
        row["compile_ms"] = (time.perf_counter() - t0) * 1e3
        ok, times = walk(engine, matcher, hf.encode(json.dumps(good), add_special_tokens=False))
        row.update(compiles=True, valid_accepted=ok, mask_us=[t * 1e6 for t in times])
        try:
            refused, _ = walk(engine, engine.compile(schema), hf.encode(json.dumps(bad), add_special_tokens=False))
            row["invalid_refused"] = not refused or not engine.accepting(matcher)
        except Exception:
            row["invalid_refused"] = True
        rows.append(row)
    return {"schemas": rows}


def summary(engine_name: str, vocab_name: str, n_vocab: int, result: dict, setup_s: float) -> dict:
    rows = result["schemas"]
    times = [t for r in rows for t in r.get("mask_us", [])]
    compiled = [r for r in rows if r.get("compiles")]
    return {
        "engine": engine_name, "vocab": vocab_name, "n_vocab": n_vocab, "setup_s": round(setup_s, 3),
        "schemas": len(rows), "compiled": len(compiled),
        "valid_accepted": sum(bool(r.get("valid_accepted")) for r in rows),
        "invalid_refused": sum(bool(r.get("invalid_refused")) for r in rows),
        "compile_ms_median": round(float(np.median([r["compile_ms"] for r in compiled])), 2) if compiled else None,
        "compile_ms_max": round(max(r["compile_ms"] for r in compiled), 2) if compiled else None,
        "mask_us_mean": round(float(np.mean(times)), 1) if times else None,
        "mask_us_p50": round(float(np.percentile(times, 50)), 1) if times else None,
        "mask_us_p99": round(float(np.percentile(times, 99)), 1) if times else None,
        "tokens": len(times),
        "misses": [f"{r['schema']}: {r.get('error', 'valid refused' if not r.get('valid_accepted') else 'invalid accepted')}"
                   for r in rows if not (r.get("compiles") and r.get("valid_accepted") and r.get("invalid_refused"))],
        "detail": rows,
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.grammar_engines", description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", choices=["demo", "real", "both"], default="both")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default: all three)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "refusion_mlx" / "bpe-151671.json"),
                        help="where the 151,671-token BPE is kept (built when missing)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="walks per schema (the masks' times pooled)")
    parser.add_argument("--json", metavar="OUT", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s): {', '.join(unknown)}; known: {', '.join(ENGINES)}")

    def body():
        vocabs = []
        if args.vocab in ("demo", "both"):
            from refusion_mlx.models.loading import resolve_model_path

            demo = Path(resolve_model_path(None))  # its embedding rows: the vocabulary an engine masks
            vocabs.append(("demo", demo / "tokenizer.json",
                           json.loads((demo / "config.json").read_text())["vocab_size"]))
        if args.vocab in ("real", "both"):
            vocabs.append(("bpe-151671", build_vocabulary(Path(args.cache)), REAL_VOCAB))
        results = []
        for vocab_name, path, n_vocab in vocabs:
            hf = hf_tokenizer(path)
            for name in engines:
                try:
                    t0 = time.perf_counter()
                    engine = ENGINES[name](hf, n_vocab)
                    setup = time.perf_counter() - t0
                except ImportError as e:
                    print(f"{name}: not installed ({e})")
                    continue
                pooled = None
                for _ in range(args.repeat):
                    one = measure(engine, hf, SCHEMAS)
                    if pooled is None:
                        pooled = one
                    else:
                        for a, b in zip(pooled["schemas"], one["schemas"]):
                            a.setdefault("mask_us", []).extend(b.get("mask_us", []))
                results.append(summary(name, vocab_name, n_vocab, pooled, setup))
                r = results[-1]
                print(f"  {vocab_name:>10} {name:<13} mask p50 {r['mask_us_p50']} us, compiled "
                      f"{r['compiled']}/{r['schemas']}", flush=True)
        print()
        print(format_table(
            ["vocab", "engine", "setup s", "compiled", "valid ok", "invalid refused", "compile ms (median/max)",
             "mask us/token mean", "p50", "p99"],
            [[r["vocab"], r["engine"], f"{r['setup_s']:.2f}", f"{r['compiled']}/{r['schemas']}",
              f"{r['valid_accepted']}/{r['schemas']}", f"{r['invalid_refused']}/{r['schemas']}",
              f"{r['compile_ms_median']}/{r['compile_ms_max']}", r["mask_us_mean"], r["mask_us_p50"],
              r["mask_us_p99"]] for r in results]))
        for r in results:
            for miss in r["misses"]:
                print(f"  {r['vocab']} {r['engine']}: {miss}")
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results}, indent=1))
            print(f"wrote {args.json}")
        return 0

    sys.exit(run(body))


if __name__ == "__main__":
    main()
