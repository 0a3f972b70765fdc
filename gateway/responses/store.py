"""The responses a `store: true` request keeps, in memory, bounded by bytes ([limits] responses_store_bytes),
least recently used first out: what `GET /v1/responses/{id}` answers, what `input_items` lists, and the
conversation `previous_response_id` continues (its items, input then output, after its own previous).

A response larger than the whole bound is not kept. An id that is missing, deleted or evicted is OpenAI's
404 (`ResponseNotFound`). Everything runs on the event loop's thread: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from bankml import jstr
from bankml.errors import ResponseNotFound


def not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    if param == "previous_response_id":
        return ResponseNotFound(f"Previous response with id '{response_id}' not found.", param=param,
                                code="previous_response_not_found")
    return ResponseNotFound(f"Response with id '{response_id}' not found.", param=param, code=None)


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object as answered, its receipt included
    input_items: list[dict]  # this request's input items
    conversation: list[dict]  # every item so far: the previous response's, this input, this output
    size_bytes: int


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self.used_bytes = 0

    def put(self, response: dict, input_items: list[dict], conversation: list[dict]) -> None:
        size = len(jstr.dumps([response, input_items, conversation]).encode("utf-8"))
        if size > self.max_bytes:
            return
        self.drop(response["id"])
        self._kept[response["id"]] = Stored(response, input_items, conversation, size)
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            _, oldest = self._kept.popitem(last=False)
            self.used_bytes -= oldest.size_bytes

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self._kept.get(response_id)
        if stored is None:
            raise not_found(response_id, param)
        self._kept.move_to_end(response_id)
        return stored

    def drop(self, response_id: str) -> bool:
        stored = self._kept.pop(response_id, None)
        if stored is not None:
            self.used_bytes -= stored.size_bytes
        return stored is not None
