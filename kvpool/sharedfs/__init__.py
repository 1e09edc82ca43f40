"""The shared tier: object files in a directory every node mounts (layout.py: formats; files.py: file I/O)."""
