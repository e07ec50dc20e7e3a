"""Incremental detokenizer against whole-text decodes of a real (tiny, offline) BPE tokenizer,
and the per-request detokenizer that the engine (stop strings) and the front end (client text)
both feed."""

from __future__ import annotations

import itertools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.text.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    DetokenizerFinished,
    IncrementalDetokenizer,
    InvalidStopString,
    RequestDetokenizer,
    TokenTexts,
    decode_text,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there",
    "stop strings end generation early",
] * 20
EMOJI_TEXT = "hi 👋🏽 and 🎉 done"
CJK_TEXT = "你好，世界！ hello 日本語"
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) trained on English only, so emoji and CJK stay split into
    single-byte tokens: most of their tokens end in the middle of a character."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer: PreTrainedTokenizerFast, **kwargs) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), **kwargs)


def stream_one_by_one(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Append ids one at a time, checking after each that no U+FFFD shows and that what was
    streamed so far is a prefix of the text (a client never sees text later taken back)."""
    chunks = []
    for token_id in ids:
        det.append([token_id])
        chunks.append(det.take_new_text())
        assert REPLACEMENT_CHAR not in det.text
        assert REPLACEMENT_CHAR not in chunks[-1]
        assert det.text.startswith("".join(chunks))
    return chunks


def token_span(tokenizer: PreTrainedTokenizerFast, ids: list[int], needle: str) -> int:
    """How many tokens the first occurrence of needle in the ASCII text of ids touches."""
    ends, length = [], 0
    for token_id in ids:
        length += len(tokenizer.decode([token_id]))
        ends.append(length)
    start = decode_text(tokenizer, ids).index(needle)
    stop = start + len(needle)
    return sum(1 for i, end in enumerate(ends) if end > start and (ends[i - 1] if i else 0) < stop)


@pytest.mark.parametrize("text", ["hello world, the lazy dog!", EMOJI_TEXT, CJK_TEXT])
def test_one_token_at_a_time_matches_whole_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    det = make(tokenizer)
    chunks = stream_one_by_one(det, ids)
    det.finish()
    chunks.append(det.take_new_text())
    assert det.text == tokenizer.decode(ids) == text
    assert "".join(chunks) == det.text


@pytest.mark.parametrize("text", [EMOJI_TEXT, CJK_TEXT])
def test_split_character_is_held_back_not_replaced(tokenizer, text):
    ids = encode(tokenizer, text)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "no split character"
    det = make(tokenizer)
    lengths = []
    for token_id in ids:
        det.append([token_id])
        lengths.append(len(det.text))
        assert REPLACEMENT_CHAR not in det.text
    assert any(a == b for a, b in itertools.pairwise(lengths)), "some token must add no text"


def test_several_tokens_per_append_matches_whole_decode(tokenizer):
    ids = encode(tokenizer, EMOJI_TEXT + " " + CJK_TEXT)
    det = make(tokenizer)
    chunks, i = [], 0
    for step, size in enumerate([1, 3, 2, 5] * 20):
        det.append(ids[i : i + size])
        chunks.append(det.take_new_text())
        assert REPLACEMENT_CHAR not in det.text, f"step {step}"
        i += size
    det.finish()
    chunks.append(det.take_new_text())
    assert det.text == tokenizer.decode(ids)
    assert "".join(chunks) == det.text


def test_empty_append_is_a_no_op(tokenizer):
    det = make(tokenizer)
    det.append([])
    assert det.text == "" and det.take_new_text() == ""


def test_special_tokens_skipped(tokenizer):
    ids = [*encode(tokenizer, "the lazy dog"), tokenizer.eos_token_id]
    det = make(tokenizer)
    stream_one_by_one(det, ids)
    assert det.text == "the lazy dog"


def test_special_tokens_kept_when_asked(tokenizer):
    ids = [*encode(tokenizer, "the lazy dog"), tokenizer.eos_token_id]
    det = make(tokenizer, skip_special_tokens=False)
    stream_one_by_one(det, ids)
    assert det.text == "the lazy dog<eos>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_text_is_the_tokenizers_own_decode(tokenizer, skip_special_tokens):
    for text in (PROMPT, EMOJI_TEXT, CJK_TEXT):
        ids = [tokenizer.eos_token_id, *encode(tokenizer, text), tokenizer.eos_token_id]
        for cut in range(len(ids) + 1):  # NOTE: most cuts end inside a character
            want = tokenizer.decode(
                ids[:cut],
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            got = decode_text(tokenizer, ids[:cut], skip_special_tokens=skip_special_tokens)
            assert got == want


def test_decode_text_keeps_a_tokenizer_classs_own_decode(tokenizer):
    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>")
    assert decode_text(shouting, encode(tokenizer, "the lazy dog")) == "THE LAZY DOG"


def test_token_texts_are_each_ids_own_decode_made_once(tokenizer):
    decoded = []

    class Counting:
        def decode(self, token_ids, **kwargs):
            decoded.append(token_ids)
            return tokenizer.decode(token_ids, **kwargs)

    texts = TokenTexts(Counting())
    ids = encode(tokenizer, "the lazy dog, the lazy fox")
    assert [texts(i) for i in ids] == [tokenizer.decode([i]) for i in ids]
    assert sorted(decoded) == sorted([i] for i in set(ids))


def test_prompt_context_keeps_leading_space_of_first_token():
    """Sentencepiece-style decoders drop the space of a sequence's first "▁" token; with the
    prompt as context the first generated word keeps its space."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Metaspace()
    word_level.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level)
    assert tokenizer.decode([2]) == "world"
    det = IncrementalDetokenizer(tokenizer, [1])
    det.append([2])
    assert det.text == " world"


class WindowSpy:
    """Wraps a tokenizer and records the longest id list any decode call received."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        self.longest = max(self.longest, len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


def test_each_step_decodes_a_small_window(tokenizer):
    spy = WindowSpy(tokenizer)
    ids = encode(tokenizer, (EMOJI_TEXT + " the lazy dog ") * 10)
    det = IncrementalDetokenizer(spy, encode(tokenizer, PROMPT * 3))
    for token_id in ids:
        det.append([token_id])
    assert len(ids) > 100
    # NOTE: the widest window is one split 4-byte character as context plus the next one.
    assert spy.longest <= max(PROMPT_CONTEXT_TOKENS + 1, 2 * 4)
    assert det.text == tokenizer.decode(ids)


def test_ids_that_decode_to_nothing_keep_the_window_small(tokenizer):
    spy = WindowSpy(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    det = IncrementalDetokenizer(spy, encode(tokenizer, PROMPT))
    for _ in range(200):
        det.append([eos])  # skipped special token: no text
    det.append(encode(tokenizer, " hello"))
    assert det.text == " hello"
    assert spy.longest <= PROMPT_CONTEXT_TOKENS + 2


def test_finish_decodes_a_trailing_partial_character_as_whole_decode_would(tokenizer):
    ids = encode(tokenizer, "ok 🎉")[:-1]
    det = make(tokenizer)
    stream_one_by_one(det, ids)
    assert det.text == "ok "
    det.finish()
    assert det.text == decode_text(tokenizer, ids)
    assert det.text.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize(("stop", "n_tokens"), [("zy", 2), ("yzz", 3)])
@pytest.mark.parametrize(("include", "expected"), [(False, "{before}"), (True, "{before}{stop}")])
def test_stop_string_straddling_tokens(tokenizer, stop, n_tokens, include, expected):
    text = "xyzzy says hi"
    ids = encode(tokenizer, text)
    assert token_span(tokenizer, ids, stop) == n_tokens
    det = make(tokenizer, stop=(stop,), include_stop_str_in_output=include)
    stream_one_by_one(det, ids)
    assert det.stopped_by == stop
    assert det.text == expected.format(before=text[: text.index(stop)], stop=stop)


def test_stop_is_detected_on_the_token_that_completes_it(tokenizer):
    ids = encode(tokenizer, "xyzzy says hi")
    det = make(tokenizer, stop=("zy",))
    stopped_at = None
    for i, token_id in enumerate(ids):
        det.append([token_id])
        if det.stopped_by is not None and stopped_at is None:
            stopped_at = i
    assert tokenizer.decode(ids[: stopped_at + 1]) == "xyzzy"


@pytest.mark.parametrize("stops", [("fox", "quick"), ("quick", "fox")])
def test_earliest_stop_string_wins(tokenizer, stops):
    det = make(tokenizer, stop=stops)
    det.append(encode(tokenizer, "the quick brown fox"))
    assert det.stopped_by == "quick"
    assert det.text == "the "


def test_stop_that_completes_first_wins_over_one_that_starts_first(tokenizer):
    det = make(tokenizer, stop=("brown fox", "row"))
    det.append(encode(tokenizer, "the quick brown fox"))
    assert (det.stopped_by, det.text) == ("row", "the quick b")


def test_streaming_never_shows_part_of_a_stop_string(tokenizer):
    det = make(tokenizer, stop=("o wor",))
    chunks = stream_one_by_one(det, encode(tokenizer, "hello world, hello there"))
    det.finish()
    chunks.append(det.take_new_text())
    assert det.stopped_by == "o wor"
    assert "".join(chunks) == det.text == "hell"


def test_finish_releases_text_held_back_for_an_unfinished_stop(tokenizer):
    det = make(tokenizer, stop=("world!",))
    streamed = "".join(stream_one_by_one(det, encode(tokenizer, "hello world")))
    assert streamed == "hello "
    det.finish()
    assert det.stopped_by is None
    assert streamed + det.take_new_text() == det.text == "hello world"


def test_appends_after_a_stop_are_ignored(tokenizer):
    det = make(tokenizer, stop=("lo",))
    det.append(encode(tokenizer, "hello"))
    assert (det.stopped_by, det.text, det.take_new_text()) == ("lo", "hel", "hel")
    det.append(encode(tokenizer, " world, lo"))
    assert (det.stopped_by, det.text, det.take_new_text()) == ("lo", "hel", "")


def test_append_after_finish_raises(tokenizer):
    det = make(tokenizer)
    det.finish()
    det.finish()
    assert det.finished
    with pytest.raises(DetokenizerFinished):
        det.append(encode(tokenizer, "hi"))


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(InvalidStopString, match="non-empty"):
        make(tokenizer, stop=("ok", ""))


# ---- RequestDetokenizer: what the engine and the front end each run per request -------------

BATCHINGS = [[1], [3], [2, 1, 4], [100]]  # ids per output: one per step, or speculative runs


def feed_outputs(det: RequestDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """Feed ids as engine outputs of the given sizes (cycled), the last one finished."""
    chunks, i = [], 0
    for size in itertools.cycle(sizes):
        batch = ids[i : i + size]
        i += size
        chunks.append(det.take_output(batch, finished=i >= len(ids)))
        if i >= len(ids):
            return chunks


@pytest.mark.parametrize("sizes", BATCHINGS)
def test_request_output_text_is_the_whole_decode(tokenizer, sizes):
    ids = encode(tokenizer, EMOJI_TEXT + " " + CJK_TEXT)
    det = RequestDetokenizer(tokenizer, encode(tokenizer, PROMPT), SamplingParams())
    chunks = feed_outputs(det, ids, sizes)
    assert "".join(chunks) == det.text == decode_text(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)


@pytest.mark.parametrize("sizes", BATCHINGS)
def test_request_stop_waits_for_min_new_tokens_however_ids_are_batched(tokenizer, sizes):
    """The first "lo" completes before min_new_tokens and is ignored, the second ends it:
    ids are fed one at a time whatever outputs they came in, as the engine feeds its own."""
    text = "hello world, hello there"
    ids = encode(tokenizer, text)
    first_lo = next(i for i in range(len(ids)) if "lo" in decode_text(tokenizer, ids[: i + 1]))
    params = SamplingParams(stop=["lo"], min_new_tokens=first_lo + 2, max_new_tokens=64)
    det = RequestDetokenizer(tokenizer, encode(tokenizer, PROMPT), params)
    chunks = feed_outputs(det, ids, sizes)
    assert det.stopped_by == "lo"
    assert "".join(chunks) == det.text == "hello world, hel"


def test_request_stop_is_found_on_the_id_that_completes_it(tokenizer):
    ids = encode(tokenizer, "xyzzy says hi")
    params = SamplingParams(stop=["zy"], include_stop_str_in_output=True)
    det = RequestDetokenizer(tokenizer, encode(tokenizer, PROMPT), params)
    fed = 0
    while det.stopped_by is None:
        det.append(ids[fed : fed + 1])
        fed += 1
    assert token_span(tokenizer, ids, "zy") == 2
    assert decode_text(tokenizer, ids[:fed]) == det.text == "xyzzy"
