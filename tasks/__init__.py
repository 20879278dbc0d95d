"""Task entry-point helpers: flag parsing for task dataclasses and full-dataset classification metrics."""
