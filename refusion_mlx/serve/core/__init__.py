"""The engine and its request: scheduling, decoding and ending requests in the
server's own terms, whichever API asked (see ``refusion_mlx.serve``)."""
