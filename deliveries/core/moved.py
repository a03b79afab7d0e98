"""Old import paths of moved modules, kept for one release.

A module that moved into the floor (``deliveries.core``) and that a host project may
name, in its settings (``deliveries.conf.q_cluster``, the JSON log formatter, the admin
middleware) or its code (``deliveries.timezones.next_local_time``), keeps its old path
as a one-line module that calls ``alias``: importing it warns once and gives the new
module itself, so a name looked up or patched through either path is the same object.
"""

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module ``old`` (being imported) the module ``new``, with a
    DeprecationWarning that names the new path."""
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
