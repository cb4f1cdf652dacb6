"""Inputs shared by the multi-process workers and the single-process reference (tests/multihost)."""

LOGIT_IDS = [[5, 9, 33, 7, 100, 42, 250, 3, 17, 64, 128, 200], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
GEN_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 6
