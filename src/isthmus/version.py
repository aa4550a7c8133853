"""The installed version of isthmus (from the package metadata; pyproject.toml is the source)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("isthmus")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
