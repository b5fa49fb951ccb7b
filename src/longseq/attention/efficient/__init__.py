"""Efficient approximations without a partition: kernels (linear, performer), low rank (linformer, nystrom),
hashing/sorting (reformer, sinkhorn), synthesized weights and Fourier mixing."""
