"""Second doors into kvpool: other stores' client surfaces on top of kvpool's Client (compat/mooncake)."""
