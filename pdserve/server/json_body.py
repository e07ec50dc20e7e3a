"""Worker routes whose JSON bodies are read with a size bound and parsed strictly
(`pdserve.edge.strict_json`): a body over `MAX_BODY_BYTES` is a 413 before the rest of it
is read, and NaN, lone surrogates or deep nesting are a 400 through FastAPI's invalid-JSON path.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from pdserve.edge.strict_json import BodyTooLarge, InvalidJSON, parse_json, read_bounded


class StrictJSONRequest(Request):
    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            try:
                self._body = await read_bounded(self.stream(), self.headers.get("content-length"))
            except BodyTooLarge as e:
                raise HTTPException(413, str(e)) from None
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except InvalidJSON as e:
                raise json.JSONDecodeError(str(e), "", 0) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """Routes whose JSON bodies go through `read_bounded` and `parse_json`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
