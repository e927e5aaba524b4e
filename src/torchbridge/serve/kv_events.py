"""A bounded log of KV-cache block events, for routers that keep an exact index of cached prefixes.

Events are numbered from 0 without gaps; a reader polls with the next id it wants (`since`). When the log
overflowed and dropped events the reader has not seen, `dropped` tells it to rebuild its index.
The JSON format is documented in `torchbridge.serve.server`.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time


class KVEventLog:
    def __init__(self, capacity: int = 65536) -> None:
        self._events: collections.deque[dict] = collections.deque(maxlen=capacity)
        self._next_id = 0
        self._lock = threading.Lock()

    def record(self, kind: str, **fields: object) -> None:
        with self._lock:
            self._events.append({"id": self._next_id, "type": kind, "ts": time.time(), **fields})
            self._next_id += 1

    def since(self, first_id: int, limit: int = 10000) -> dict:
        with self._lock:
            oldest = self._next_id - len(self._events)
            # A reader ahead of the log saw another incarnation of this server: it must rebuild too.
            dropped = first_id < oldest or first_id > self._next_id
            start = oldest if first_id > self._next_id else max(first_id, oldest)
            events = list(itertools.islice(self._events, start - oldest, start - oldest + limit))
            return {"events": events, "next": start + len(events), "dropped": dropped}
