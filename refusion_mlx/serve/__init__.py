"""Serving ReFusion to programs: the OpenAI-compatible HTTP server
(``http_server``: ``RefusionServer``; ``app`` its routes, ``schemas`` its
request models, ``engine`` the batching loop, ``prompt_cache`` the caches
kept across requests). Its command line is ``python -m refusion_mlx.server``."""
