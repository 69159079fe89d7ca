"""The network and how it is loaded: the model contract (``base``), the
families by ``model_type`` (``registry``: ``qwen3``, ``llama``) on the
decoder-only LM they share (``causal_lm``), per-token RoPE (``rope``), the
device-dependent operations (``cpu_paths``, ``kernels``, chosen by
``backend``), projections joined into one matmul after loading (``projections``), adapters
(``adapters``), tensor and pipeline splits (``sharding``) and checkpoint
loading from a folder or the hub (``loading``). How a decode pass runs
through a model is ``decode/runner.py``'s."""
