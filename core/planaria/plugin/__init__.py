"""The plugin system: markers, hook specifications, records and the manager."""

import pluggy

PROJECT_NAME = "planaria"
ENTRY_POINT_GROUP = "planaria"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "hookimpl", "hookspec"]
