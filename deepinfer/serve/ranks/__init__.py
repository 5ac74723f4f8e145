"""The engine rank processes: their supervision (start, health, restarts, regroups), the
request stream to and from them, their IPC, and the rank process itself."""
