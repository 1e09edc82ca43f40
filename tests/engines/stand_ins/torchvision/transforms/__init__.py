"""Placeholders for torchvision.transforms (see the package docstring)."""

from torchvision import unavailable


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable(f"transforms.{name}")
