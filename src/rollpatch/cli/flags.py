"""Command-line flags made from a config class's own fields: the command line's name for the
builders in :mod:`rollpatch.config` (``add_config_flags``, ``config_kwargs``, ``flag_name``),
which live there so that a package below the command line (``python -m rollpatch.netem``)
builds its flags the same way.
"""

from __future__ import annotations

from ..config import add_config_flags, config_kwargs, flag_name

__all__ = ["add_config_flags", "config_kwargs", "flag_name"]
