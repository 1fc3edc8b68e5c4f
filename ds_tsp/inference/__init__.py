"""Hugging Face's ``generate`` on a TSP model: the cached forward and the sequence-sharded ``Cache``."""
