"""The Responses API's stored responses, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``: in memory, at most
``ServerConfig.max_stored_responses`` of them, least recently used out.

An entry keeps the response as it was answered and its conversation in the
chat template's form (the input's messages, without ``instructions``, and
the answer as an assistant message), so that a follow-up renders the same
conversation again and the prompt cache finds its prefix: it prefills only
what is new. With ``--api-key`` an entry belongs to the key that made it
(``owner``: the key's hash, :data:`.security.KEY_SCOPE`): another key
neither reads, continues nor deletes it -- it is not there for that key.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import List, Optional


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as answered
    conversation: List[dict]  # its messages and the answer, for the next turn's prompt
    owner: str = ""  # the hash of the API key that made it ("": none given)


class ResponseStore:
    """Responses by id, bounded (``max_entries``; 0 keeps none)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.entries: "collections.OrderedDict[str, StoredResponse]" = collections.OrderedDict()
        self.lock = threading.Lock()

    def put(self, response: dict, conversation: List[dict], owner: str = "") -> None:
        with self.lock:
            if self.max_entries <= 0:
                return
            self.entries[response["id"]] = StoredResponse(response, conversation, owner)
            self.entries.move_to_end(response["id"])
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)

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
            del self.entries[response_id]
            return True

    def __len__(self) -> int:
        return len(self.entries)
