"""The compiler's version: written into every module it makes (`producer`) and part of every cache key."""

__version__ = "0.2.0"
