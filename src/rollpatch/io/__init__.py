"""Reading and writing checkpoints and views (safetensors, torch state-dict files)."""

from .safetensors import (
    load_view,
    read_view_ranges,
    save_view,
    view_chunks,
    view_from_bytes,
    view_to_bytes,
)

__all__ = [
    "load_view",
    "read_view_ranges",
    "save_view",
    "view_chunks",
    "view_from_bytes",
    "view_to_bytes",
]
