"""Reading Server-Sent Event streams in tests."""

from __future__ import annotations

import json

import httpx


def events(response: httpx.Response) -> list:
    """The JSON payloads of a finished stream, up to (not including) `data: [DONE]`."""
    found = []
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        found.append(json.loads(data))
    return found


def stream_post(url: str, body: dict, timeout: float = 60) -> tuple[int, list]:
    with httpx.stream("POST", url, json=body, timeout=timeout) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        return 200, events(response)
