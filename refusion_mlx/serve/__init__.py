"""Serving ReFusion to programs: the OpenAI-compatible HTTP server
(``http_server``: ``RefusionServer``; ``server_config`` its one config,
``app`` its routes, ``schemas`` its request models and their adapter into
the one request shape inside, ``engine_request``; ``engine`` the batching
loop, which refuses with a ``refusal`` reason that ``http_errors`` answers;
``prompt_cache`` the caches kept across requests). Its command line is
``python -m refusion_mlx.server``."""
