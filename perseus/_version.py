"""The perseus version, in a module of its own that imports nothing: the package and the launcher
(``perseusrun --version``) both read it, and setup.py parses it."""

__version__ = "0.1.0"
