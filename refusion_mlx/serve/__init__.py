"""Serving ReFusion to people and programs: the OpenAI-compatible HTTP server
(``server``) and the terminal chat with cache reuse between turns (``chat``)."""
