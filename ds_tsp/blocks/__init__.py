"""The TSP modules that replace a Hugging Face block: attention, the gated MLP, the experts, the folded vocabulary.
They import only ``ds_tsp.parallel``: no DeepSpeed, no planner (a schedule choice is handed in at injection)."""
