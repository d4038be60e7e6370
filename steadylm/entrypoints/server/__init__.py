"""The OpenAI-compatible HTTP server (`steadylm serve`)."""
