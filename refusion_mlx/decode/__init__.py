"""ReFusion decoding (REFUSION.md §2-§6): parameters and presets, the
committed cache, the plan / verify / infill / commit loop, the answer
released in order, and the streaming ``generate`` API."""
