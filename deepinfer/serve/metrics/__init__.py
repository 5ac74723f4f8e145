"""The server's Prometheus metrics: the API process's own, and the collectors that read the
ranks, their experts and the prompt tokenizer."""
