"""The variable that puts prometheus_client in multiprocess mode (several API processes). Here,
apart from server.py, because it must be set before prometheus_client is first imported."""
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
