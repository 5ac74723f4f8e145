"""Where a rank's results go: one socket per API process (--api-server-count).

Every API process sends requests to every rank and reads the results of its own requests only,
so the rank remembers which process each request came from. Process 0 also owns the ranks'
lives (start, heartbeats, restarts): start-up reports and heartbeats go to it alone. Every
process gets each step's stats (least-loaded routing and the metrics read them); a process
that has nothing else in a step gets them only if its socket has room, so a slow reader
never stalls the step loop for numbers the next step refreshes.
"""
from __future__ import annotations

from collections import defaultdict

import zmq

from deepinfer.serve.ranks.ipc import EngineStats, RequestError, StepResult, TokenDelta


class RankOutbox:
    def __init__(self, ctx: zmq.Context, addrs: tuple[str, ...]) -> None:
        if not addrs:
            raise ValueError("a rank needs at least one API process to report to")
        self.sockets = []
        for addr in addrs:
            socket = ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(addr)
            self.sockets.append(socket)
        self._owners: dict[str, list[int]] = {}  # request id -> [API process, open samples]

    def send(self, message: object) -> None:
        """To API process 0 (start-up reports, its replies)."""
        self.sockets[0].send_pyobj(message)

    def reply(self, client: int, message: object) -> None:
        self.sockets[self._client_index(client)].send_pyobj(message)

    def broadcast(self, message: object) -> None:
        for client, socket in enumerate(self.sockets):
            self._send_stats(client, socket, message)

    # ---- requests ------------------------------------------------------------------------
    def admit(self, request_id: str, client: int, num_samples: int) -> None:
        if len(self.sockets) > 1:
            self._owners[request_id] = [self._client_index(client), num_samples]

    def forget(self, request_id: str) -> None:
        self._owners.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._owners)

    def step_result(self, rank: int, deltas: list[TokenDelta], errors: list[RequestError],
                    stats: EngineStats) -> None:
        """The step's deltas and errors to the processes that own them; stats to all."""
        if len(self.sockets) == 1:
            self.sockets[0].send_pyobj(StepResult(rank, deltas, errors, stats))
            return
        by_client: dict[int, StepResult] = defaultdict(lambda: StepResult(rank, [], [], stats))
        for delta in deltas:
            by_client[self._owner(delta.request_id, delta.finished)].deltas.append(delta)
        for error in errors:
            by_client[self._owner(error.request_id, True)].errors.append(error)
            self.forget(error.request_id)
        for client, socket in enumerate(self.sockets):
            result = by_client.get(client)
            if result is not None:
                socket.send_pyobj(result)
            else:
                self._send_stats(client, socket, StepResult(rank, [], [], stats))

    def _owner(self, request_id: str, sample_ended: bool) -> int:
        entry = self._owners.get(request_id)
        if entry is None:
            return 0  # unknown (never admitted here): process 0 drops what it does not know
        if sample_ended:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._owners[request_id]
        return entry[0]

    def _client_index(self, client: int) -> int:
        return client if 0 <= client < len(self.sockets) else 0

    @staticmethod
    def _send_stats(client: int, socket: zmq.Socket, message: object) -> None:
        if client == 0:
            socket.send_pyobj(message)
            return
        try:
            socket.send_pyobj(message, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # that process is not reading (yet): the next step's stats replace these
