"""One adapter per API (a body into a ``Draft``) and its writer (the engine's
events into its answer); a new API is its own files and one line of
``core.apis.PROTOCOLS``."""
