"""One request's grammar state (:class:`Matcher`), over a constraint that
:mod:`.grammar` compiled: the tokens decided so far in position order, the
bitmask of tokens allowed next (:func:`allowed_rows` puts it on the device),
what the grammar forces, and rollback -- what the constrained mode
(``constrain.py``) needs to check drafts as speculative decoding does."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from .grammar import Compiled


def allowed_forced(matcher) -> List[int]:
    """llguidance's forced tokens as far as its parser takes them (its tokenizer makes text of text,
    :mod:`.ll_tokenizer`; what the parser would refuse still never goes out as forced)."""
    tokens = [int(t) for t in matcher.compute_ff_tokens()]
    return tokens[:int(matcher.validate_tokens(tokens))] if tokens else tokens



class Matcher:
    """One request's grammar state: the tokens decided so far, in position order.

    ``consume`` takes decided tokens (each must be allowed: the constrained mode
    only decides tokens that are). ``masks(drafts)`` reads without changing it:
    the bitmask allowed now and after each of the drafts in turn, as long as
    they are allowed (rollback restores the state). ``forced`` is what the
    grammar forces next (a schema's fixed keys, braces, quotes).
    """

    def __init__(self, compiled: "Compiled", made=None):
        from llguidance import LLMatcher

        self.compiled = compiled
        self.words = (compiled.vocab + 31) // 32
        self.m = made if made is not None else LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        self.eos_id = compiled.eos_id

    def consume(self, tokens: Sequence[int]) -> int:
        """Decide ``tokens``; returns how many the grammar took (all, when they
        were checked first). EOS after a complete answer counts as taken: a
        stopped matcher takes nothing more, EOS included."""
        tokens = [int(t) for t in tokens]
        body = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
        n = int(self.m.try_consume_tokens(body)) if body else 0
        if n < len(body) or len(body) == len(tokens):
            return n
        if self.m.is_stopped() or self.m.try_consume_tokens([self.eos_id]) == 1:
            return n + 1
        return n

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (unchanged)."""
        return int(self.m.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    def masks(self, drafts: Sequence[int]) -> np.ndarray:
        """Bitmasks (len(drafts) + 1, words): allowed now, then after drafts[0],
        after drafts[0:2], ... while the drafts are allowed; rows after the
        first refused draft allow everything (nothing there is decided)."""
        out = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        self._fill(out, 0)
        taken = self.valid_prefix(drafts)
        walked = 0
        for i in range(taken):
            if int(drafts[i]) == self.eos_id or not self.m.consume_token(int(drafts[i])):
                break  # nothing after an EOS is decided
            walked += 1
            self._fill(out, i + 1)
        if walked:
            self.m.rollback(walked)
        return out

    def _fill(self, out: np.ndarray, row: int) -> None:
        self.m.unsafe_compute_mask_ptr(out.ctypes.data + row * out.strides[0], out.strides[0])

    def forced(self) -> List[int]:
        """The tokens the grammar forces next (may be empty): llguidance's
        forced tokens, then the rest of the text it forces (a key and its
        ``": "``, which several tokenizations could spell, so none is forced
        as a token) in the tokenizer's own tokenization, as far as the
        grammar takes it -- text a model does not choose costs no forward."""
        if self.m.is_stopped():
            return []
        tokens = allowed_forced(self.m)
        text = bytes(self.m.compute_ff_bytes())
        lltok = self.compiled.tokenizer
        head = lltok.decode_bytes(tokens) if tokens else b""
        if len(text) > len(head) and text.startswith(head):
            more = tokens + [int(t) for t in lltok.tokenize_bytes(text[len(head):])]
            tokens = more[:int(self.m.validate_tokens(more))]
        return tokens

    @property
    def stopped(self) -> bool:
        """Nothing but EOS may follow."""
        return self.m.is_stopped()

    def error(self) -> Optional[str]:
        return self.m.get_error() if self.m.is_error() else None


def allowed_rows(bitmask: np.ndarray, vocab: int) -> mx.array:
    """Bitmask rows (n, words) int32 -> allowed (n, vocab) booleans on the
    device (bit j % 32 of word j // 32 says whether token j is allowed)."""
    words = mx.array(bitmask.view(np.uint32))
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].astype(mx.bool_)
