"""Collectives (counted, with explicit groups), the token layouts, the process groups and the dtype policy of sums."""
