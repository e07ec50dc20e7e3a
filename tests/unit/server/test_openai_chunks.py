"""A streamed chunk's SSE event (`_View.chunk_event`) is the whole chunk's JSON, its envelope
encoded once per response."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.server.openai_api import _View


@pytest.mark.parametrize("chat", [True, False])
def test_a_chunk_event_is_its_envelope_in_json(chat):
    state = SimpleNamespace(served_model_name='odd "model" [] name', token_texts=None)
    obj = "chat.completion" if chat else "text_completion"
    view = _View("x", obj, state, logprobs=False, chat=chat, request_id="r1")
    assert view.id == "x-r1"
    choices = [
        {"index": 0, "delta": {"content": 'a "quoted" [] text'}, "finish_reason": None},
        {"index": 1, "text": "\u00e9\n", "logprobs": None, "finish_reason": "stop"},
    ]
    for choice in choices:
        event = view.chunk_event(choice)
        assert event == f"data: {json.dumps(view.envelope(True, [choice]))}\n\n"
        assert json.loads(event.removeprefix("data: "))["choices"] == [choice]
