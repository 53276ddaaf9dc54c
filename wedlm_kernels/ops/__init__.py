"""One module per kernel family: Triton kernel(s), launcher, and the PyTorch implementation."""
