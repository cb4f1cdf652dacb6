"""The model as pure functions: its config and presets, the per-shard layers, linear layers from bf16 or FP8
weights, the MTP layer, `step` / `forward`, parameters (from a checkpoint or random) and their placement on the
mesh, and the paged caches' shapes and slots. Nothing here imports `glm_dsa.serving`."""
