"""Reading and writing checkpoints and views (safetensors, torch state-dict files)."""

from .safetensors import load_view, save_view, view_from_bytes, view_to_bytes

__all__ = ["load_view", "save_view", "view_from_bytes", "view_to_bytes"]
