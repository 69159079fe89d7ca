"""ReFusion decoding (the paper's plan / verify / infill loop, https://arxiv.org/abs/2512.13586,
walked through in docs/design.md): parameters and presets, the
committed cache, the plan / verify / infill / commit loop, the answer
released in order, the streaming ``generate`` API (``stream``), and a
conversation that reuses its cache from turn to turn (``conversation``)."""
