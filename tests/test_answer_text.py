"""The answer's text released with a windowed (streaming) decode: the same
pieces as re-decoding the whole answer at every step, for linear work."""

import random
from pathlib import Path

import pytest

from refusion_mlx.decode.answer import AnswerText, StreamingText, decodes_locally
from refusion_mlx.models.loading import load_tokenizer

from tests.helpers import commit, committed_cache

DEMO = Path(__file__).resolve().parent.parent / "refusion_mlx" / "demo" / "tiny-refusion"
EOS = 801  # <|im_end|>
TEXTS = ["Sven lives in Hanoi.", " naïve café, déjà vu", "中文字符测试", "emoji 🦀🐢 and ∑ ≠ ∞",
         "tabs\tand\nnew lines\r\n", "  spaces  before", "Ω", "ok"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


class WholeDecode:
    """Today's release before the window: the whole answer decoded at every step."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def add(self, ids, final=False):
        self.ids += ids
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:
            full = full.rstrip("\ufffd")
        if not full.startswith(self.text):
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


def random_answer(tokenizer, rng, n):
    """Ids mixing words, multi-byte characters (split across byte tokens), lone
    bytes of a multi-byte character, special tokens and random vocabulary."""
    ids = []
    specials = [799, 800, 802, 803, 804, 805]
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.45:
            ids += tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
        elif kind < 0.6:
            ids.append(rng.choice(specials))
        elif kind < 0.7:  # the first bytes of a multi-byte character, cut off
            whole = tokenizer.encode(rng.choice("中文🦀∑é"), add_special_tokens=False)
            ids += whole[:rng.randrange(1, len(whole) + 1)]
        else:
            ids.append(rng.randrange(len(tokenizer)))
    return ids[:n]


def slices(rng, ids):
    i = 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3, 5, 8])
        yield ids[i:i + k]
        i += k


def test_streamed_pieces_equal_the_whole_decode_step_by_step(tokenizer):
    rng = random.Random(0)
    for case in range(300):
        ids = random_answer(tokenizer, rng, rng.randrange(1, 120))
        stream, whole = StreamingText(tokenizer), WholeDecode(tokenizer)
        out = []
        for part in slices(rng, ids):
            piece = stream.add(part)
            assert piece == whole.add(part), (case, ids)
            out.append(piece)
        last = stream.add([], final=True)
        assert last == whole.add([], final=True)
        out.append(last)
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True), (case, ids)
        assert not stream.whole  # the window never had to fall back on this tokenizer


def test_answer_text_out_of_order_commits_equal_the_whole_decode(tokenizer):
    """Through AnswerText: slots committed out of order, EOS cutting the answer."""
    rng = random.Random(1)
    for case in range(100):
        ids = random_answer(tokenizer, rng, rng.randrange(4, 160))
        if rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids)), EOS)
        start = 37
        slots = [list(range(i, min(i + 4, len(ids)))) for i in range(0, len(ids), 4)]
        rng.shuffle(slots)
        cache = committed_cache()
        answer, out = AnswerText(tokenizer, cache, start, EOS), []
        for slot in slots:
            commit(cache, [start + i for i in slot], [ids[i] for i in slot])
            _, text = answer.update()
            out.append(text)
        out.append(answer.finish())
        kept = ids[:ids.index(EOS) + 1] if EOS in ids else ids
        assert answer.tokens == kept
        assert "".join(out) == tokenizer.decode(kept, skip_special_tokens=True), (case, ids)
        assert "<|" not in "".join(out)  # no special token's text


def test_incomplete_character_is_held_until_it_completes_or_ends(tokenizer):
    crab = tokenizer.encode("🦀", add_special_tokens=False)
    assert len(crab) > 1  # a byte token at a time
    stream = StreamingText(tokenizer)
    assert [stream.add([t]) for t in crab] == [""] * (len(crab) - 1) + ["🦀"]
    stream = StreamingText(tokenizer)
    assert stream.add(crab[:-1]) == ""
    assert stream.add([], final=True) == tokenizer.decode(crab[:-1])  # the end releases it as is
    assert stream.text.endswith("\ufffd")


class Counting:
    """The demo tokenizer (mlx-lm's wrapper), counting the ids passed to decode."""

    def __init__(self, tokenizer):
        self._tokenizer, self.ids = tokenizer._tokenizer, 0  # the Hugging Face one, as the wrapper

    def __len__(self):
        return len(self._tokenizer)

    def decode(self, ids, **kwargs):
        self.ids += len(ids)
        return self._tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("step", [1, 4])
def test_decode_work_is_linear_in_the_answer(tokenizer, step):
    rng = random.Random(2)
    ids = random_answer(tokenizer, rng, 2000)
    counting = Counting(tokenizer)
    cache = committed_cache()
    answer = AnswerText(counting, cache, 0, EOS)
    out = []
    for i in range(0, len(ids), step):
        commit(cache, range(i, min(i + step, len(ids))), ids[i:i + step])
        out.append(answer.update()[1])
    out.append(answer.finish())
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.ids <= 12 * len(ids)  # the whole decode at every step: ~n^2/2 / step ids
    assert answer.stream.decoded == counting.ids and not answer.stream.whole
    assert len(answer.stream.ids) <= 4 * step + 8  # only the window: the ids themselves live in the cache


def test_non_local_decode_falls_back_to_the_whole_decode():
    """A decode that changes text across ids (here: 'b' after 'a' reads 'B')
    is decoded whole once the window sees it: the pieces stay the same."""

    class Tok:
        def __len__(self):
            return 26

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids).replace("ab", "aB")

    rng = random.Random(3)
    for _ in range(50):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        added = []  # what a holder of the ids would give back (AnswerText: the cache)
        stream, whole = StreamingText(Tok(), window=True), WholeDecode(Tok())
        held = StreamingText(Tok(), window=True, history=lambda: list(added))
        for part in slices(rng, ids):
            added += part
            piece = whole.add(part)
            assert stream.add(part) == piece and held.add(part) == piece
        assert stream.add([], final=True) == whole.add([], final=True) == held.add([], final=True)
        assert stream.text == whole.text == held.text


def test_clean_up_spaces_decodes_whole():
    """clean_up_tokenization_spaces rewrites text across ids: decoded whole, as
    before (which holds everything after a rewrite of released text)."""

    class Tok:
        clean_up_tokenization_spaces = True

        def __len__(self):
            return 4

        def decode(self, ids, skip_special_tokens=True):
            return "".join(" ,"[i % 2] for i in ids).replace(" ,", ",")

    stream, whole = StreamingText(Tok()), WholeDecode(Tok())
    assert stream.whole and not decodes_locally(Tok())
    for part, final in [([0], False), ([1], False), ([0, 0], True)]:
        assert stream.add(part, final) == whole.add(part, final)
    assert stream.text == whole.text


def test_which_tokenizers_decode_a_window(tokenizer):
    from mlx_lm.tokenizer_utils import NewlineTokenizer

    assert decodes_locally(tokenizer) and decodes_locally(tokenizer._tokenizer)
    assert not StreamingText(tokenizer).whole and StreamingText(tokenizer, window=False).whole

    class Stub:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    newline = NewlineTokenizer(tokenizer_object=tokenizer._tokenizer.backend_tokenizer,
                               clean_up_tokenization_spaces=False)
    assert not decodes_locally(Stub()) and not decodes_locally(newline)  # its own decode: "<n>" spans ids


def spm_tokenizer():
    """A Llama-style tokenizer: "\u2581" for spaces, byte fallback, the first space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update((f"<0x{b:02X}>", 3 + b) for b in range(256))
    for piece in ["\u2581", "\u2581\u2581", "\u2581Hello", "\u2581world", "Hello", "a", "\u2581a", ",", "\u2581,",
                  ".", "\n", "\u2581the", "ab"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def test_spm_leading_space_and_byte_fallback_equal_the_whole_decode():
    """The first space of a decode is stripped and byte tokens group into
    characters: the window's context carries both, so the pieces still match."""
    spm = spm_tokenizer()
    assert decodes_locally(spm)
    n = len(spm)
    utf8 = [3 + b for ch in "é中🦀" for b in ch.encode()]
    rng = random.Random(4)
    fallbacks = 0
    for case in range(400):
        ids = []
        while len(ids) < rng.randrange(1, 60):
            kind = rng.random()
            ids += ([rng.randrange(259, n)] if kind < 0.5 else [rng.choice([1, 2])] if kind < 0.6
                    else utf8[(i := rng.randrange(len(utf8))):i + rng.randrange(1, 5)] if kind < 0.8
                    else [rng.randrange(3, 259)])
        stream, whole = StreamingText(spm), WholeDecode(spm)
        for part in slices(rng, ids):
            assert stream.add(part) == whole.add(part), (case, ids)
        assert stream.add([], final=True) == whole.add([], final=True), (case, ids)
        assert stream.text == whole.text
        fallbacks += stream.whole
    assert fallbacks < 100  # a byte run that turns invalid rewrites released text: decoded whole then
