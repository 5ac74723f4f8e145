"""The HTTP API: the app and its routes, request parsing and checks, errors, SSE, connection
guards and the drain on shutdown."""
