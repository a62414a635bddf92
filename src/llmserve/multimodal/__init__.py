"""Images for multimodal models: decoding and preprocessing (image.py), prompts with images (processor.py)."""
