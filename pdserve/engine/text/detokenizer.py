"""Incremental detokenization with stop strings, for streaming output.

Decoding every generated id at each step costs O(n) per token. Instead each step decodes only a
small window of recent ids (the prefix/read offset technique vLLM and TGI use):

    ids: [ ... | prefix_offset ..... read_offset | read_offset ..... end ]
                 already emitted, kept as context   not yet emitted

`decode(ids[prefix:read])` is text already emitted; `decode(ids[prefix:])` is that text plus the
new text. Decoding new ids after a little context keeps the tokenizer's leading-space rules
(sentencepiece's "▁" at the start of a sequence) right, so the first window is seeded with the
last few prompt ids. If the new text ends in U+FFFD, the last id stopped inside a multi-byte
UTF-8 character: nothing is emitted and the window grows until the character completes.

Stop strings are searched in the new text plus the `max(len(stop)) - 1` characters before it, so
a stop string split across tokens is still found. Streaming (`take_new_text`) holds back any
trailing text that could still grow into a stop string, so a client never sees part of one.

Where text is made (SGLang's detokenizer-manager split): the engine keeps a `RequestDetokenizer`
only for a request with stop strings, to know when it stops; it reports token ids. Text for
clients is made beside it, in the worker's front end (and by `LLM.generate` offline), by another
`RequestDetokenizer` fed the ids the engine reports. Both run the same deterministic algorithm,
fed the same way, over the same ids, so they find a stop string at the same token and cut the
text at the same character.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.engine.core.sampling_params import SamplingParams

# NOTE: prompt ids that seed the first window: enough for any tokenizer's leading-space rule
# to see a preceding token, few enough to keep each decode cheap.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer that detokenization needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


class InvalidStopString(ValueError):
    """A stop string cannot be used (it is empty, so it would match everywhere)."""


class DetokenizerFinished(RuntimeError):
    """Tokens were appended after `finish()`: the request already ended."""


def decode_text(
    tokenizer: TokenDecoder, token_ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """Decode a whole sequence at once, exactly as the incremental path joins it up.

    Space clean-up (" ." -> ".") is off: it depends on text not yet generated, so the
    incremental path cannot apply it, and a non-streaming response must read the same.
    """
    if _decodes_with_its_backend_only(type(tokenizer)):
        # NOTE: what transformers' decode runs for such a tokenizer with clean-up off, less
        # its per-call argument handling (a third of a streamed token's detokenization).
        return tokenizer.backend_tokenizer.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens
        )
    return tokenizer.decode(
        list(token_ids),
        skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _decodes_with_its_backend_only(cls: type) -> bool:
    """True for a `tokenizers`-backed tokenizer class whose decode is transformers' own: it
    hands the ids to the Rust backend and, with clean-up off, returns what that gives."""
    from transformers import PreTrainedTokenizerFast

    return (
        issubclass(cls, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    )


class TokenTexts:
    """Each token id's own text, `tokenizer.decode([id])` as logprobs show a token, decoded
    once per id (at most the vocabulary's size) instead of once per token streamed."""

    def __init__(self, tokenizer: TokenDecoder):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


class IncrementalDetokenizer:
    """Turns one request's generated ids into text a few at a time, and applies stop strings.

    `append` the ids sampled each step; `text` is all complete text so far; `take_new_text`
    returns the streamable increment; `stopped_by` names the stop string once one matched,
    after which appends are ignored. Call `finish` when the request ends for another reason
    (EOS, length, abort) to release whatever streaming held back.

    When several stop strings match in the same text, the one that completes first wins (ties:
    the one that starts first), which is what a character-by-character scan would see; the
    result does not depend on how the text was split into tokens.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        if any(not s for s in stop):
            raise InvalidStopString(f"stop strings must be non-empty, got {stop!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""
        self._returned = 0  # characters of _text already handed out by take_new_text
        self._stopped_by: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All output text so far: complete characters only, truncated at a stop string."""
        return self._text

    @property
    def stopped_by(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stopped_by

    @property
    def finished(self) -> bool:
        """True once `finish()` was called."""
        return self._finished

    def append(self, token_ids: Sequence[int], *, check_stop: bool = True) -> None:
        """Feed ids generated this step (one, or several with speculative decoding).
        `check_stop=False` leaves stop strings unchecked for this text (as before
        min_new_tokens is reached); a match that ends in later text is still found."""
        if self._finished:
            raise DetokenizerFinished("append() after finish(): the request already ended")
        if self._stopped_by is not None or not token_ids:
            return
        self._ids.extend(token_ids)
        self._add_text(self._decode_pending(flush=False), check_stop)

    def take_new_text(self) -> str:
        """Text not returned by earlier calls, less any tail that may begin a stop string."""
        end = len(self._text)
        if not self._finished and self._stopped_by is None:
            end -= self._stop_prefix_len()
        # NOTE: end >= _returned always: text that reached a client was no stop-string prefix
        # then, so no later match or held-back tail can begin before it.
        chunk = self._text[self._returned : end]
        self._returned = end
        return chunk

    def finish(self) -> None:
        """End the request: decode any ids still pending and stop holding text back.

        Ids that end inside a character are decoded as they are (with U+FFFD), as a whole-text
        decode would. Calling it twice is harmless.
        """
        if self._finished:
            return
        if self._stopped_by is None:
            self._add_text(self._decode_pending(flush=True))
        self._finished = True

    def _decode(self, token_ids: list[int]) -> str:
        return decode_text(
            self._tokenizer, token_ids, skip_special_tokens=self._skip_special_tokens
        )

    def _decode_pending(self, *, flush: bool) -> str:
        """New text of the ids past read_offset; "" while they end inside a character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        # NOTE: ids that decode to nothing (skipped special tokens, ids the tokenizer does not
        # know) still advance the window; only a trailing partial character keeps ids pending,
        # so the window stays a few ids wide whatever the model emits.
        if full_text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _add_text(self, new_text: str, check_stop: bool = True) -> None:
        if not new_text:
            return
        # A match ending in older text would have stopped us already, so only matches that end
        # in new_text are possible; they start at most max_stop_len - 1 characters before it.
        search_from = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        if self._stop and check_stop:
            self._apply_stop(search_from)

    def _apply_stop(self, search_from: int) -> None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = self._text.find(stop, search_from)
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return
        end, start, stop = best
        self._stopped_by = stop
        self._text = self._text[: end if self._include_stop else start]

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for length in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self._stop):
                return length
        return 0


class RequestDetokenizer:
    """One request's detokenizer: its `SamplingParams`' text settings, fed one id at a time,
    stop strings checked once `min_new_tokens` ids were generated.

    NOTE: this is the one way ids reach a request's detokenizer, in the engine (stop strings)
    and where client text is made (front end, `LLM`): one id per `append` of the inner
    detokenizer, with the same `check_stop`, whatever batches the ids arrive in (one per step,
    several with speculative decoding). That is what makes both sides agree on the stop point.
    """

    def __init__(
        self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ):
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self._min_new_tokens = params.min_new_tokens
        self._has_stop = bool(params.stop)
        self._num_tokens = 0

    @property
    def text(self) -> str:
        return self._detokenizer.text

    @property
    def stopped_by(self) -> str | None:
        return self._detokenizer.stopped_by

    def append(self, token_ids: Sequence[int]) -> None:
        """Feed generated ids (the request's next ones, in order)."""
        if not self._has_stop:
            # NOTE: without stop strings the text does not depend on how ids are batched:
            # one decode for all of them.
            self._num_tokens += len(token_ids)
            self._detokenizer.append(token_ids, check_stop=False)
            return
        for token_id in token_ids:
            self._num_tokens += 1
            self._detokenizer.append(
                [token_id], check_stop=self._num_tokens >= self._min_new_tokens
            )

    def take_output(self, new_token_ids: Sequence[int], *, finished: bool) -> str:
        """Feed one engine output's new ids; return the text a client may see now: none of a
        stop string, all of the rest once the request `finished`."""
        self.append(new_token_ids)
        if finished:
            self._detokenizer.finish()
        return self._detokenizer.take_new_text()
