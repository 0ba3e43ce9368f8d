"""Engine-side multimodal inputs: a request's images (validated, M-RoPE positions, prefix-cache keys),
the image-embedding cache, and the per-step inputs of steps whose tokens include image pads."""
