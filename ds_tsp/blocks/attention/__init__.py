"""TSP attention: the broadcast schedule over head groups, the K/V all-gather along the zigzag sequence."""
