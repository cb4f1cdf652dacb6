"""Helpers shared by the ops: RMSNorm / LayerNorm (`norms`), RoPE (`rope`), row chunks (`chunking`), the FP8 byte
formats and the 128 x 128 block codec (`fp8_formats`), and the Pallas helpers of the Triton and Mosaic GPU kernels
(`triton_common`, `mosaic_common`, imported by the kernels only)."""
