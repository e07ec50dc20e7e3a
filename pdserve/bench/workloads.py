"""What a benchmark sends: seeded, reproducible conversations of one or more turns.

Every workload is a list of `Conversation`s; a single-request workload is a list of one-turn
conversations, so the runner has one shape to drive. A turn's prompt is either token ids
(`/v1/completions` accepts them) or user text built from `WORDS`, about one token per word
with common BPE tokenizers. What the server counted comes back in each answer's usage.

- `random`: input and output lengths uniform in inclusive ranges; token-id prompts for
  completions (ids uniform in [token_id_min, token_id_max)), text of that many words for chat.
- `sharegpt`: one user message per conversation: from a ShareGPT JSON file when given
  (`load_sharegpt`: its first human turns, each with its answer's length), else text of the
  imitated lengths `sharegpt_lengths` draws.
- `multi-turn`: a system prompt per conversation (optionally after one shared by every
  conversation), then several user turns; each turn's messages are the previous turn's
  messages plus the answer it got plus the new user message (`Conversation.messages`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("random", "sharegpt", "multi-turn")

# Short common English words: most are one token in Llama, Qwen or GPT tokenizers.
_WORD_LIST = """
    the of and to in is was for on are with as at be by this had not but from or have an they
    which one you were her all she there would their we him been has when who will more
    no if out so said what up its about into than them can only other new some could time
    these two may then do first any my now such like our over man me even most made after
    also did many before must through back years where much your way well down should
    because each just those people how too little state good very make world still own see
    men work long get here between both life being under never day same another know while
    last might us great old year off come since against go came right used take three
    place small found part again light water keep tree green river stone house road cold
    warm hand open close early late table window paper story music city field garden north
    south east west clear short round plain quiet bright sound voice heart mind learn teach
    write read speak listen build carry change follow"""
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of lengths, parsed from `N` or `MIN:MAX`."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range {self.low}:{self.high}: need 1 <= MIN <= MAX")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        low, colon, high = text.partition(":")
        try:
            bounds = int(low), int(high if colon else low)
        except ValueError:
            raise ValueError(f"length range {text!r}: expected N or MIN:MAX (integers)") from None
        return cls(*bounds)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Turn:
    """One request: the user's prompt (token ids, completions only, or text) and how many
    tokens to ask for."""

    prompt: tuple[int, ...] | str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    system: str = ""

    def messages(self, answers: list[str]) -> list[dict[str, str]]:
        """Chat messages for turn `len(answers)`: the system prompt, each earlier turn with
        the answer it received, then this turn's user message. Turn k's messages are thus a
        prefix of turn k+1's."""
        turn = len(answers)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for earlier, answer in zip(self.turns[:turn], answers, strict=True):
            messages.append({"role": "user", "content": _text(earlier.prompt)})
            messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": _text(self.turns[turn].prompt)})
        return messages

    def completion_prompt(self, turn: int) -> list[int] | str:
        """The prompt for /v1/completions: token ids as they are, text after the system
        prompt. Only single-turn conversations go there (no answers to weave in)."""
        prompt = self.turns[turn].prompt
        if isinstance(prompt, tuple):
            return list(prompt)
        return f"{self.system}\n\n{prompt}" if self.system else prompt


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload and its lengths. Lengths are tokens for token-id prompts and outputs,
    words for text prompts."""

    name: str
    chat: bool  # text prompts for /v1/chat/completions, else token ids (random) or text
    input_len: LengthRange
    output_len: LengthRange
    token_id_min: int = 3
    token_id_max: int = 250
    max_input_len: int = 1024  # sharegpt's clip
    max_output_len: int = 512
    num_turns: int = 4  # multi-turn
    system_prompt_len: int = 32  # words, per conversation
    shared_prefix_len: int = 0  # words every conversation's system prompt starts with
    # sharegpt from a file: (prompt, output length) pairs, `load_sharegpt`; () imitates them
    dataset: tuple[tuple[str, int], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if not 0 <= self.token_id_min < self.token_id_max:
            raise ValueError(
                f"token ids [{self.token_id_min}, {self.token_id_max}): need 0 <= MIN < MAX"
            )
        if self.name == "multi-turn" and not self.chat:
            raise ValueError("the multi-turn workload needs --endpoint chat")
        for name in ("max_input_len", "max_output_len", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.system_prompt_len < 0 or self.shared_prefix_len < 0:
            raise ValueError("system-prompt and shared-prefix lengths must be >= 0")


def build_workload(spec: WorkloadSpec, count: int, seed: int) -> list[Conversation]:
    """`count` conversations of `spec`, the same for the same seed."""
    rng = random.Random(seed)
    if spec.name == "random":
        return [_random_conversation(spec, rng) for _ in range(count)]
    if spec.name == "sharegpt" and spec.dataset:
        return _sharegpt_file_conversations(spec, rng, count)
    if spec.name == "sharegpt":
        return [_sharegpt_conversation(spec, rng) for _ in range(count)]
    # NOTE: the shared prefix comes from its own generator, so every seed (each run of a
    # sweep) shares the same one, as a deployment's common system prompt would.
    shared = words(random.Random(0x5EED), spec.shared_prefix_len)
    return [_multi_turn_conversation(spec, rng, shared) for _ in range(count)]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def sharegpt_lengths(rng: random.Random, max_input: int, max_output: int) -> tuple[int, int]:
    """(input, output) lengths with the skewed shape of ShareGPT's first turns, imitated, not
    sampled from the data set: both lognormal, input with median 220 and sigma 1.0 (mean about
    360, a long tail of pasted documents), output with median 180 and sigma 0.8 (mean about
    250), each rounded and clipped to [4, max_input] and [1, max_output]."""
    prompt = round(rng.lognormvariate(math.log(220), 1.0))
    output = round(rng.lognormvariate(math.log(180), 0.8))
    return min(max(prompt, 4), max_input), min(max(output, 1), max_output)


def _random_conversation(spec: WorkloadSpec, rng: random.Random) -> Conversation:
    length = spec.input_len.sample(rng)
    if spec.chat:
        prompt: tuple[int, ...] | str = words(rng, length)
    else:
        prompt = tuple(rng.randrange(spec.token_id_min, spec.token_id_max) for _ in range(length))
    return Conversation((Turn(prompt, spec.output_len.sample(rng)),))


def _sharegpt_conversation(spec: WorkloadSpec, rng: random.Random) -> Conversation:
    prompt, output = sharegpt_lengths(rng, spec.max_input_len, spec.max_output_len)
    return Conversation((Turn(words(rng, prompt), output),))


def load_sharegpt(path: str | Path, max_input: int, max_output: int) -> tuple[tuple[str, int], ...]:
    """(prompt, output length) of each usable conversation of a ShareGPT JSON file (a list of
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}, ...]}): its
    first turn, asked by a human and answered, with the answer's length in words (about its
    tokens) clipped to [1, max_output]. As vLLM does, conversations whose prompt is under 4
    or over `max_input` words are left out, not clipped."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--dataset-path {str(path)!r}: cannot read it as JSON: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"--dataset-path {str(path)!r}: not a ShareGPT file (a JSON list)")
    usable = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        asked, answered = turns[0], turns[1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            continue
        if asked.get("from") != "human":
            continue
        prompt_words = len(asked["value"].split())
        if 4 <= prompt_words <= max_input:
            output = min(max(len(answered["value"].split()), 1), max_output)
            usable.append((asked["value"], output))
    if not usable:
        raise ValueError(
            f"--dataset-path {str(path)!r}: no conversation with a human first turn of 4 to "
            f"{max_input} words and an answer"
        )
    return tuple(usable)


def _sharegpt_file_conversations(
    spec: WorkloadSpec, rng: random.Random, count: int
) -> list[Conversation]:
    """`count` of the file's conversations in a seeded random order; drawn again (with
    repeats) when the file has fewer, as vLLM oversamples."""
    order = list(spec.dataset)
    rng.shuffle(order)
    chosen = order[:count] + [rng.choice(order) for _ in range(count - len(order))]
    return [Conversation((Turn(prompt, output),)) for prompt, output in chosen]


def _multi_turn_conversation(spec: WorkloadSpec, rng: random.Random, shared: str) -> Conversation:
    own = words(rng, spec.system_prompt_len)
    system = " ".join(part for part in (shared, own) if part)
    turns = tuple(
        Turn(words(rng, spec.input_len.sample(rng)), spec.output_len.sample(rng))
        for _ in range(spec.num_turns)
    )
    return Conversation(turns, system)


def _text(prompt: tuple[int, ...] | str) -> str:
    if not isinstance(prompt, str):
        raise TypeError("token-id prompts go to /v1/completions, not into chat messages")
    return prompt
