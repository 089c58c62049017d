"""Vision towers and image inputs: the Qwen3.5 tower (``qwen3_5.py``), multimodal rotary
positions (``positions.py``), and reading, bounding and preprocessing images (``images.py``).
Nothing here is imported by a text-only load."""
