"""OpenAI's Files and Batches APIs: JSONL files of requests run at low priority beside online
traffic, their state on disk so that a restart resumes them (store.py, runner.py), and the line
format shared with the offline `llmserve run-batch` (lines.py)."""
