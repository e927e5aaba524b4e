"""The router's session table: session id -> the replica its last request went to, bounded.

Agents open sessions without closing them, so the table keeps the `max_sessions` most recently used
and forgets the oldest (a forgotten session only loses its affinity hint; the prefix index still
steers its next request to the replica holding its context).
"""

from __future__ import annotations

from collections import OrderedDict


class SessionTable(OrderedDict[str, str]):
    def __init__(self, max_sessions: int = 100_000) -> None:
        super().__init__()
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions

    def __setitem__(self, session: str, replica: str) -> None:
        super().__setitem__(session, replica)
        self.move_to_end(session)
        while len(self) > self.max_sessions:
            self.popitem(last=False)

    def forget_replica(self, replica: str) -> None:
        for s in [s for s, r in self.items() if r == replica]:
            del self[s]
