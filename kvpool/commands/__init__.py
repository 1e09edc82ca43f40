"""The `kvpool` command and the programs behind its subcommands."""
