"""The network and how it is loaded: Qwen3 with a position id per token
(``qwen3``; its RoPE in ``rope``, its device-dependent operations in
``cpu_paths``, its fused linear layers and their Hugging Face names in
``fused``), adapters (``adapters``) and checkpoint loading from a folder or
the hub (``loading``)."""
