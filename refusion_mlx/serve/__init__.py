"""Serving ReFusion to programs: the HTTP server for chat apps and agents
(``http_server``: ``RefusionServer``; ``server_config`` its one config,
``app`` its routes; each API a thin adapter into the one request shape
inside, ``engine_request``: OpenAI's completions ``schemas`` and
``openai_api``, ``responses_api``, Anthropic's ``anthropic_api``;
``answering`` the way from any of them to an answer or a stream;
``tool_calls`` the model's calls; ``engine`` the batching loop, which
refuses with a ``refusal`` reason that ``http_errors`` answers in each API's
shape; ``prompt_cache`` the caches kept across requests). Its command line
is ``python -m refusion_mlx.server``."""
