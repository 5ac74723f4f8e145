"""Chat formats: rendering a conversation with the checkpoint's template (or DeepSeek's own
encoding), reading tool calls back out of the output, and the checkpoint's sampling defaults."""
