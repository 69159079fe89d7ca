"""The network and how it is loaded: Qwen3 with a position id per token
(``qwen3``) and checkpoint loading from a folder or the hub (``loading``)."""
