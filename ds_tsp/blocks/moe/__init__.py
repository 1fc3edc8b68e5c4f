"""The TSP sparse mixture-of-experts block: experts E/D per rank, met on the ring or by a token all-to-all."""
