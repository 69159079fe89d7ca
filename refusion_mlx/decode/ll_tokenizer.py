"""The tokenizer as llguidance sees it, with text tokenized as text.

llguidance tokenizes the text a grammar forces (a schema's constant, a
pattern's fixed part) with the model's tokenizer, which turns every spelling
of one of its added tokens into that token: a constant ``"<think>"`` became
the special token ``<think>``, the mask allowed it alone, and the matcher
then refused it (a special token is not the text it spells) -- an error in
the middle of an answer. Here the engine tokenizes with a copy of the
tokenizer that reads those tokens' spellings as plain text (as the chat
template's text is read, ``stream._chat_ids``): text a grammar writes is
always text, and a special token is written only where a grammar names it
(``<tool_call>`` in a forced call).
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Optional

from ..errors import DecodeError

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer: mlx-lm's wrapper holds it, or it is one."""
    inner = getattr(tokenizer, "_tokenizer", None)
    return inner if hasattr(inner, "convert_tokens_to_ids") else tokenizer


class TextTokenizer:
    """What llguidance's ``TokenizerWrapper`` reads: every token's bytes and
    which are special, as llguidance's own view of ``hf`` has them, and an
    encoder that never makes a special token of text."""

    def __init__(self, hf, seen, eos_id: int):
        import tokenizers

        n = seen.vocab_size
        self.eos_token_id, self.bos_token_id = eos_id, None
        self.tokens = [seen.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if seen.is_special_token(i)]
        special = set(self.special_token_ids)
        data = json.loads(hf.backend_tokenizer.to_str())
        for added in data.get("added_tokens") or ():
            added["special"] = added.get("special") or added.get("id") in special
        self.backend = tokenizers.Tokenizer.from_str(json.dumps(data))
        self.backend.no_padding()
        self.backend.no_truncation()
        self.backend.encode_special_tokens = True  # special tokens' spellings are text

    def __call__(self, text: str):
        return self.backend.encode(text, add_special_tokens=False).ids


def ll_tokenizer(tokenizer, vocab: int, eos_id: int):
    """llguidance's view of a Hugging Face fast tokenizer (mlx-lm's wrapper or
    the tokenizer itself) over the model's ``vocab`` rows, its text tokenized
    as text (:class:`TextTokenizer`); built once per tokenizer (a few seconds
    at 151,671 tokens)."""
    import llguidance
    import llguidance.hf

    hf, cached, key = hf_tokenizer(tokenizer), _cached(tokenizer), (vocab, eos_id)
    if key not in cached:
        try:
            seen = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos_id, slices=[])
            text = llguidance.TokenizerWrapper(TextTokenizer(hf, seen, eos_id))
            cached[key] = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos_id)
        except Exception as e:
            raise DecodeError(f"constrained decoding needs a Hugging Face fast tokenizer ({e})") from None
    return cached[key]


def _cached(tokenizer) -> dict:
    """The views built for ``tokenizer``'s Hugging Face tokenizer, by (vocab, eos id)."""
    try:
        return _TOKENIZERS.setdefault(hf_tokenizer(tokenizer), {})
    except TypeError:  # not weakly referable: not cached
        return {}


def warm(tokenizer, copies, vocab: int, eos_id: int) -> None:
    """Build the view of ``tokenizer`` now and give it to ``copies`` too
    (tokenizers loaded from the same folder, used on other threads: the view
    reads none of them once built), so that no request waits seconds for it:
    a server's first call with tools otherwise did, its lane held meanwhile.
    A tokenizer llguidance cannot read is left to the first request to say so."""
    try:
        built = ll_tokenizer(tokenizer, vocab, eos_id)
    except DecodeError:
        return
    for copy in copies:
        _cached(copy)[(vocab, eos_id)] = built


def one_token(tokenizer, text: str) -> bool:
    """Whether ``text`` is one token of the tokenizer's own vocabulary."""
    hf = hf_tokenizer(tokenizer)
    try:
        i = hf.convert_tokens_to_ids(text)
        return isinstance(i, int) and i != getattr(hf, "unk_token_id", None) and hf.convert_ids_to_tokens(i) == text
    except Exception:
        return False


def check_named_tokens(source: str, name: str, tokenizer, eos_id: int, mask_id: Optional[int]) -> None:
    """A Lark grammar (``source``, called ``name`` in errors) names no token that is not text: EOS (it ends an
    answer by itself), the model's mask token (it was committed as a decided token) or the tokenizer's other
    special tokens (padding, begin of text). Tokens that chat templates write as text (``<tool_call>``,
    ``<think>``) may be named."""
    if names_token(source, tokenizer, eos_id):
        raise DecodeError(f"{name}: names the end-of-sequence token, which ends an answer by itself: leave it "
                          "out of the grammar")
    special = [mask_id] + list(getattr(hf_tokenizer(tokenizer), "all_special_ids", None) or [])
    named = next((t for t in special if t is not None and t != eos_id
                  and names_token(source, tokenizer, t)), None)
    if named is not None:
        what = "the model's mask token, which marks a position not yet decided" if named == mask_id \
            else "a special token, which is not text"
        raise DecodeError(f"{name}: names {what} (id {named}): leave it out of the grammar")


def names_token(source: str, tokenizer, token: int) -> bool:
    """Whether a Lark grammar names ``token`` (``<|im_end|>`` or ``<[801]>``) outside its quoted strings."""
    bare = re.sub(r'"(?:\\.|[^"\\])*"', "", source)
    try:
        name = hf_tokenizer(tokenizer).convert_ids_to_tokens(token)
    except Exception:
        name = None
    return f"<[{token}]>" in bare or bool(name) and name in bare
