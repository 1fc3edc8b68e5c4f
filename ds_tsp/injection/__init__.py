"""A Hugging Face causal LM rewritten into TSP blocks: the policy tables, the probe, the decoder layer and model."""
