"""Storage node: owns memory segments and serves their bytes over the data protocol."""
