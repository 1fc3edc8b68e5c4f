"""The DeepSpeed engine, the optimizer over the shards, offloads and the Hugging Face Trainer for TSP models."""
