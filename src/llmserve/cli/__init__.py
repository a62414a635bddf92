"""The `llmserve` command line."""
