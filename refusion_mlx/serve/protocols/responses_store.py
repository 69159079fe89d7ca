"""The Responses API's stored responses, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``: in memory, at most
``ServerConfig.max_stored_responses`` of them holding at most
``max_stored_response_bytes`` of JSON all together, least recently used
out. An input item keeps only the fields the API defines for its type
(unknown ones never reach the prompt, and are not kept either).

An entry keeps the response as it was answered and its conversation in the
chat template's form (the input's messages, without ``instructions``, and
the answer as an assistant message), so that a follow-up renders the same
conversation again and the prompt cache finds its prefix: it prefills only
what is new. With ``--api-key`` an entry belongs to the key that made it
(``owner``: the key's hash, :data:`..edge.security.KEY_SCOPE`): another key
neither reads, continues nor deletes it -- it is not there for that key.
"""

from __future__ import annotations

import collections
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
# the fields an input item keeps, by its type (the rest is dropped), and a content part's
ITEM_FIELDS = {"message": ("type", "id", "role", "content", "status"),
               "function_call": ("type", "id", "call_id", "name", "arguments", "status"),
               "function_call_output": ("type", "id", "call_id", "output", "status")}
PART_FIELDS = ("type", "text", "refusal")


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as answered
    conversation: List[dict]  # its messages and the answer, for the next turn's prompt
    owner: str = ""  # the hash of the API key that made it ("": none given)
    input_items: tuple = ()  # the request's own input as items, with ids (GET .../input_items)
    nbytes: int = 0  # the JSON size of all of it, counted against the store's max_bytes


class ResponseStore:
    """Responses by id, bounded by count (``max_entries``; 0 keeps none) and
    by the JSON size of what they hold (``max_bytes``)."""

    def __init__(self, max_entries: int, max_bytes: int = 64 << 20):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: "collections.OrderedDict[str, StoredResponse]" = collections.OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    def put(self, response: dict, conversation: List[dict], owner: str = "", input_items=()) -> bool:
        """Keep a response (least recently used ones out to make room); False
        when it alone is over ``max_bytes`` (it is not kept)."""
        size = sum(len(json.dumps(part)) for part in (response, conversation, list(input_items)))
        with self.lock:
            if self.max_entries <= 0 or size > self.max_bytes:
                return False
            old = self.entries.pop(response["id"], None)
            self.nbytes += size - (old.nbytes if old is not None else 0)
            self.entries[response["id"]] = StoredResponse(response, conversation, owner, tuple(input_items), size)
            while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
                self.nbytes -= self.entries.popitem(last=False)[1].nbytes
            return True

    def get(self, response_id: str, owner: str = "") -> Optional[StoredResponse]:
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is not None and entry.owner != owner:
                return None
            if entry is not None:
                self.entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, owner: str = "") -> bool:
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self.nbytes -= self.entries.pop(response_id).nbytes
            return True

    def __len__(self) -> int:
        return len(self.entries)


def input_items(value: Union[str, List[Dict[str, Any]]]) -> List[dict]:
    """A request's ``input`` as the items ``GET /v1/responses/{id}/input_items``
    lists: a string is one user message; a message's string content becomes
    one text part; an ``output_text`` part has ``annotations`` (empty); every
    item has an id (its own, or a new one) and, where its type has one, a
    status; only the fields of its type are kept (:data:`ITEM_FIELDS`)."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        kind = item.get("type", "message")
        item = {k: v for k, v in item.items() if k in ITEM_FIELDS.get(kind, ("type", "id"))}
        item["type"] = kind
        if isinstance(item.get("content"), list):
            item["content"] = [{k: v for k, v in p.items() if k in PART_FIELDS} if isinstance(p, dict) else p
                               for p in item["content"]]
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            for part in item.get("content") or ():  # an output_text part has its annotations (none here)
                if isinstance(part, dict) and part.get("type") == "output_text":
                    part["annotations"] = []
        if "status" in ITEM_FIELDS.get(kind, ()):
            item.setdefault("status", "completed")
        if item.get("id") is None:  # absent or null: a new one
            item["id"] = f"{ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"
        out.append(item)
    return out


def item_page(items: Sequence[dict], limit: int = 20, order: str = "desc", after: Optional[str] = None,
              before: Optional[str] = None) -> Optional[dict]:
    """OpenAI's list object over ``items`` (in input order): ``order`` desc
    from the last; ``after``/``before`` an item id the page starts after or
    ends before; None when such an id is not among the items. Ids differ (the
    API refuses a duplicate); were one there twice, ``after`` would start past
    its last place and ``before`` end at its first, so paging always moves on."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [i["id"] for i in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            return None
        if name == "after":
            start = len(ids) - ids[::-1].index(cursor)
        else:
            end = ids.index(cursor)
    window = ordered[start:end]
    data = window[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(window) > limit}
