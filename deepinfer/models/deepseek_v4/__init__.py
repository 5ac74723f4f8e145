"""DeepSeek-V4 over backend ops."""
