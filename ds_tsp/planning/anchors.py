"""Published numbers the planner is set beside (DESIGN.md 1 and 9).

The TSP paper's setting (llama-7b shape, S = 128K, B = 1, 8 GPUs, bf16: 38.8 GB
TSP, 70.0 TP, 85.0 / 140.0 TP+SP) needs full activation checkpointing: without
it this model puts TP(8) at about 365 GB per GPU, past an MI300X's 192 GB, so
``--paper`` turns checkpointing on for every strategy. With it the estimates
keep the paper's order, TSP < TP < its TP+SP layouts; the measured peaks are
1.1-1.2x the estimates, TP's 0.98x (``tables.format_table`` prints the
comparison). The paper describes TSP schedules for attention and the MLP only,
so its TSP is compared with ``TSP(8) replicated vocab``.

Snowflake's ALST (Bekman et al. 2025, arXiv 2506.13996) trains Llama-3.1-8B at
500K tokens on one H100-80GB, 3.7M on one node of 8 and 15M on 4 nodes (32);
``longest.max_seq_len`` sets those lengths beside its own for that setting.
"""

# Peak GB per GPU reported by the paper: llama-7b shape, S = 128K, B = 1, 8 MI300X per replica.
# Its two TP+SP layouts are not named in DESIGN.md; their model states 16P/t leave
# about 31 GB of activations at t=2 x c=4 (85.0) and at t=1 x c=8 (140.0), so they
# are placed there (t=4 x c=2 would leave 58 GB, twice the other two). The paper
# describes TSP schedules for attention and the gated MLP only, so its TSP is
# set beside ds_tsp's TSP with the embedding and LM head whole on every rank.
PAPER_SETTING = dict(model="llama-7b", seq_len=131072, micro_batch=1, devices=8, dtype="bf16")
PAPER_PEAK_GB = {"TSP(8) replicated vocab": 38.8, "TP(8)": 70.0, "TP+SP(2x4)": 85.0, "SP-Ulysses(8)": 140.0}
PAPER_LABELS = {"SP-Ulysses(8)": "TP+SP t=1 x c=8"}
PAPER_DEVICE_GB = 192  # MI300X

# ALST's published longest sequences, tokens, by H100-80GB count (decimal K/M, as published).
ALST_MODEL = "llama3.1-8b"
ALST_DEVICE_GB = 80
ALST_PUBLISHED = {1: 500_000, 8: 3_700_000, 32: 15_000_000}
# Host memory per node: neither DESIGN.md nor the figures above give it. Assumed: 2 TB, a DGX H100's system
# memory (8 H100-80GB per node, as ALST's nodes). At the published lengths ALST's offloaded checkpoints take
# about 1 TB per node (32 layers x 3.7M tokens x 4096 x 2 B on one node; 15M over four), so 2 TB does not bind.
ALST_HOST_MEMORY_GB = 2000
ALST_DEVICES_PER_NODE = 8
