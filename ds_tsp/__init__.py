"""ds_tsp: tensor-sequence parallelism (TSP) for DeepSpeed."""
