"""Serving ReFusion to programs: the HTTP server for chat apps and agents.
Its command line is ``python -m refusion_mlx.server``.

The folders show the way a request takes, from the outside in:

* ``edge/`` -- HTTP and security: the Host, Origin, key and body checks
  (``security``), errors in each API's shape (``http_errors``), the way
  from a request to its answer or stream (``answering``: a protocol's
  :class:`Writer` shapes the events), the OpenAPI document, the web page.
* ``protocols/`` -- one adapter per API, each its own files: OpenAI's chat
  and text completions (``openai_*``), the Responses API (``responses_*``),
  Anthropic's Messages API (``anthropic_*``), the tokenizer routes, and the
  body pieces they share (``bodies``). An adapter turns a body into a
  ``Draft``; a writer turns the engine's events into its API's answer.
* ``core/`` -- the engine and its request, which know no API: the one
  request shape (``engine_request``: ``Draft`` -> ``finish`` ->
  ``EngineRequest``), the scheduler (queue, batch, admission), the engine
  thread, a request in flight (``job``) and how it ended (``outcome``),
  refusals, memory admission, metrics, tool calls, structured output,
  scoring; ``apis`` lists the APIs (one line each) that the rest reads.
* ``caches/`` -- the prompt cache kept across requests, and its files.

At the top: ``http_server`` (``RefusionServer``), ``server_config`` (its
one ``ServerConfig``) and ``app`` (the FastAPI app: the edge, then each
protocol's routes). ``docs/design.md`` walks one request through them.
"""
