"""A small byte-level BPE tokenizer built offline, for tests and benchmarks.

The tokenizer is trained at build time on a corpus embedded in this module, so it needs no
downloads and building it twice gives byte-identical files. Its initial alphabet is all 256
bytes (GPT-2 style byte-to-unicode mapping), so any text, emoji and CJK included, round-trips
through encode/decode; the merges only make common English cheaper.

Special tokens take the first ids, in the order of `SPECIAL_TOKENS`. Encoding does NOT add
special tokens (no bos is prepended), as with Qwen tokenizers: callers that want a bos add it
themselves, and the chat template is ChatML-like without a bos.

NOTE: in a directory whose config.json says `model_type: qwen2`, transformers 5's
`AutoTokenizer` ignores `tokenizer_class` and rebuilds the tokenizer as `Qwen2Tokenizer` from
the vocabulary and merges, with Qwen's split regex and an NFC normalizer. This tokenizer uses
the same regex and declares `unk_token: null` (as Qwen's own files do, otherwise
`Qwen2Tokenizer` adds an `<|endoftext|>` token), so both load paths give the same ids for
NFC-normalized text. Only there is non-NFC text (e.g. "e" + combining accent) normalized.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

TARGET_VOCAB_SIZE = 1000

# Qwen2's pre-tokenization split (digits one by one). transformers 5 loads a `qwen2` model
# directory through `Qwen2Tokenizer`, which rebuilds the pipeline with this regex, so using it
# here keeps the tokenization the same whichever class `AutoTokenizer` picks.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. A serving engine splits the work of a "
    "language model into two phases: prefill, which reads the whole prompt at once, and "
    "decode, which produces one token at a time. Prefill is limited by compute, while decode "
    "is limited by memory bandwidth, so running them on separate machines lets each one be "
    "sized for its own bottleneck.",
    "Once upon a time there was a small village by the sea. Every morning the fishermen went "
    "out in their boats, and every evening they came back with stories about the weather, "
    "the wind and the fish they had seen. The children listened and asked questions: why is "
    "the sky blue, where does the rain come from, and how far away is the moon?",
    "To install the package, run the following command in your terminal. Then open the "
    "configuration file, set the number of workers to 4 and the port to 8000, and start the "
    "server. If something goes wrong, check the log file for errors and warnings, and make "
    "sure that the model path points to a directory with a config file and the weights.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 2))\n\n"
    'if __name__ == "__main__":\n    main()\n',
    "Water boils at one hundred degrees Celsius at sea level, but at the top of a mountain it "
    "boils at a lower temperature because the air pressure is lower. Scientists learned this "
    "by careful experiments, measuring temperature and pressure with simple instruments.",
    "For dinner, chop two onions and three cloves of garlic, fry them in olive oil until they "
    "are golden, add the tomatoes, salt and pepper, and let the sauce simmer for twenty "
    "minutes. Meanwhile, cook the pasta in plenty of boiling water and serve it warm.",
    "History remembers great kings and queens, but most people lived quiet lives: farmers "
    "planted wheat and barley, merchants traveled between cities, and writers recorded what "
    "they heard in long letters that we still read today.",
    "Attention computes a weighted sum of values, where the weights come from the similarity "
    "between queries and keys. The key and value vectors of earlier tokens are stored in a "
    "paged cache, so that each decoding step only processes the newest token.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.\n"
    "User: How many days are there in a week?\nAssistant: There are seven days in a week.\n"
    "User: Can you write a short poem about the ocean?\nAssistant: Sure! Here it is.",
    "In 2024, the team measured a throughput of 12,345 tokens per second with a batch size "
    "of 64 and a time to first token of 150 ms. The results were 3.5% better than last year, "
    "and the memory usage dropped from 80 GB to 72 GB.",
)

_SUBJECTS = (
    "the model",
    "a scheduler",
    "the cache",
    "our team",
    "the student",
    "a small cat",
    "the teacher",
    "this function",
    "the request",
    "every worker",
    "the old man",
    "my friend",
)
_VERBS = (
    "reads",
    "writes",
    "sends",
    "receives",
    "finds",
    "keeps",
    "moves",
    "checks",
    "builds",
    "explains",
    "remembers",
    "computes",
)
_OBJECTS = (
    "the next token",
    "a long prompt",
    "the answer",
    "many pages",
    "a simple example",
    "the results",
    "an important question",
    "the first line",
    "some memory",
    "the story",
    "a new idea",
    "the data",
)
_ENDINGS = (
    "before the deadline",
    "in the morning",
    "without any errors",
    "very quickly",
    "for the second time",
    "after a short break",
    "with great care",
    "on the other machine",
    "and then stops",
    "because it is needed",
)


def training_corpus() -> list[str]:
    """The embedded training corpus: fixed paragraphs plus seeded template sentences."""
    rng = random.Random(1234)
    sentences = []
    for _ in range(1500):
        sentence = " ".join(
            (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ENDINGS))
        )
        sentences.append(sentence[0].upper() + sentence[1:] + rng.choice((".", ".", "!", "?")))
    generated = [" ".join(sentences[i : i + 10]) for i in range(0, len(sentences), 10)]
    return list(_PARAGRAPHS) * 20 + generated


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # NOTE: the ByteLevel post-processor only fixes offsets; it adds no special tokens.
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def build_tokenizer(out_dir: Path) -> None:
    """Train the tiny tokenizer and save it to `out_dir` in the Hugging Face format.

    `transformers.AutoTokenizer.from_pretrained(out_dir)` then loads it offline.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    hf_tokenizer.save_pretrained(out_dir)
