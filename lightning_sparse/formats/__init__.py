"""Files in and out: dense export with the masks folded in, compressed safetensors, and
Cerebras Model Zoo sparsity configs."""
