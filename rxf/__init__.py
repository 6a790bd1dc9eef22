"""rxf: an LLM serving engine built as a plugin framework."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Runtime", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import rxf` (done by every plugin and every child process) stays cheap.
    if name == "Runtime":
        from rxf.entrypoints.runtime import Runtime

        return Runtime
    raise AttributeError(name)
