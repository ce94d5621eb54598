"""Plugin files (`plugin_<type>_<name>.py`, loaded by path from plugin-manifest.json) and their shared helpers."""
