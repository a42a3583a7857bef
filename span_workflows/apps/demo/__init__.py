"""``make demo`` and the notebooks' helpers: the demo run, its corpus, the pictures."""
