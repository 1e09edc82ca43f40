"""The release version, in one place: pyproject.toml reads it, `kvpool.__version__` is it, every server logs and
exports it (kvpool/runtime/process.py). CHANGELOG.md says what each release changed, docs/upgrades.md which
releases work together."""

VERSION = "0.2.0"
