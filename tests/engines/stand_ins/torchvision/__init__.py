"""A stand-in for torchvision, put on sys.path only by tests/engines/in_sglang.py; not part of any engine.

SGLang's memory-pool modules import torchvision on their way (for multimodal image preprocessing that the
KV-cache pools never call). PyPI's torchvision wheels are CUDA builds (their extension links libc10_cuda.so),
so none of them imports beside the CPU torch these tests run on. The names those imports ask for exist here
and refuse to be used: a test that reached image preprocessing would fail loudly, never silently.
"""

__version__ = "0.0.0+stand-in"


class _Unavailable(type):
    """A placeholder class: attribute lookups give more placeholders, building or calling one raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return unavailable(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision.{cls.__name__} is not available: this is the test stand-in")


def unavailable(name: str) -> type:
    return _Unavailable(name, (), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable(name)
