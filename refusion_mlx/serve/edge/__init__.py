"""The HTTP edge: security checks, errors in each API's shape, the way from a
request to its answer or stream, the OpenAPI document and the web page."""
