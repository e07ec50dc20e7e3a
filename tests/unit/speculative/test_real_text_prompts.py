"""The benchmark's chat prompts: the held-out set shares no topic and no phrasing with the
training set, so acceptance measured on it is acceptance on text the head never saw."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import real_text_prompts as prompts


def test_held_out_topics_and_templates_never_appear_in_training():
    train_topics = {t.lower() for t in prompts.TRAIN_TOPICS}
    assert len(train_topics) == len(prompts.TRAIN_TOPICS), "a training topic is listed twice"
    for topic in prompts.HELD_OUT_TOPICS:
        assert topic.strip().lower() not in train_topics, topic
    assert not set(prompts.TRAIN_TEMPLATES) & set(prompts.HELD_OUT_TEMPLATES)
    held_out = prompts.chat_prompts("held_out")
    train = prompts.chat_prompts("train")
    assert len(train) == len(prompts.TRAIN_TOPICS) * len(prompts.TRAIN_TEMPLATES) * len(
        prompts.TRAIN_STYLES
    )
    train_texts = {p["messages"][0]["content"] for p in train}
    assert len(train_texts) == len(train), "two training prompts are the same text"
    for record in held_out:
        assert record["messages"][0]["content"] not in train_texts
    # nor inside a training topic ("lightning rods" would teach "lightning")
    for topic in prompts.HELD_OUT_TOPICS:
        core = topic.lower().removeprefix("the ")
        assert not [t for t in train_topics if core in t], topic


def test_topics_are_clean_names():
    for topic in prompts.TRAIN_TOPICS + prompts.HELD_OUT_TOPICS:
        assert topic and topic == topic.strip() and "\n" not in topic, repr(topic)
