"""Placeholders for torchvision.transforms.functional (see the package docstring)."""

from torchvision import unavailable


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable(f"transforms.functional.{name}")
