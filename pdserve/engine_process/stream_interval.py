"""`--stream-interval N` (SGLang's flag): the engine process sends a request's new tokens to
the front end once N of them piled up, instead of after every step.

Each output the front end gets costs it about the same whatever it carries (the message's
checks, a detokenizer call, an SSE event written to the socket), so at a small model's decode
rates a worker's front end, one Python process, can set the pace (benchmarks/RESULTS.md,
"The front end's CPU per streamed token"); N tokens an output divide that work by about N,
at the price of a chunkier stream. Never held: a request's first output (its time to first
token stays as it is), its last (finished or failed), and the tokens before a failure, which
go out ahead of it.
"""

from __future__ import annotations

from collections.abc import Container

from pdserve.protocol.engine_messages import TokenOutput


class StreamInterval:
    """Holds each request's outputs until `interval` new tokens piled up (1: holds none)."""

    def __init__(self, interval: int):
        if interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {interval}")
        self.interval = interval
        self._held: dict[str, TokenOutput] = {}

    @property
    def num_held(self) -> int:
        return len(self._held)

    def pass_on(self, outputs: list[TokenOutput], live: Container[str]) -> list[TokenOutput]:
        """Of a step's `outputs`, what goes to the front end now, in order. `live`: the
        engine's unfinished requests; what is held for any other request is dropped (it was
        aborted, and an aborted request gets no output of its own)."""
        if self.interval == 1:
            return outputs
        ready = []
        for output in outputs:
            held = self._held.pop(output.request_id, None)
            if held is not None:
                if output.failure is not None:
                    ready.append(held)  # NOTE: the tokens before a failure, ahead of it
                else:
                    output = held.followed_by(output)
            if self._due(output):
                ready.append(output)
            else:
                self._held[output.request_id] = output
        if self._held:
            for request_id in [r for r in self._held if r not in live]:
                del self._held[request_id]
        return ready

    def drop(self, request_id: str) -> None:
        """Forget what is held for an aborted request."""
        self._held.pop(request_id, None)

    def _due(self, output: TokenOutput) -> bool:
        return (
            output.finished
            or output.failure is not None
            or len(output.new_token_ids) >= self.interval
            # NOTE: the request's first output: every token so far is new in it.
            or output.num_output_tokens <= len(output.new_token_ids)
        )
