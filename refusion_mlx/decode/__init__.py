"""ReFusion decoding (REFUSION.md §2-§6): parameters and presets, the
committed cache, the plan / verify / infill / commit loop, the answer
released in order, the streaming ``generate`` API (``stream``), and a
conversation that reuses its cache from turn to turn (``conversation``)."""
