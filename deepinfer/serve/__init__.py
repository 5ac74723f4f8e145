"""The OpenAI-compatible server: API process + one engine process per rank."""
