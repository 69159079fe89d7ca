"""Errors that reach a user as one line (CLI: non-zero exit; server: HTTP 4xx)."""


class RefusionError(ValueError):
    """A problem with the user's input or files."""


class ConfigError(RefusionError):
    """A config.json this runtime cannot run."""


class LoadError(RefusionError):
    """A model folder or hub id that cannot be loaded."""


class DecodeError(RefusionError):
    """Invalid decoding parameters or prompt."""
