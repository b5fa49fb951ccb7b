"""The CPU engine: everything that exists only to make attention fast on a CPU, in one folder.

The ``cpu_flash`` backend of ``attention.backend`` (``ops.dispatch``) runs these paths; the semantics they compute
are written once elsewhere (the variants' explicit paths, ``Partition``, ``attention_matrix``), and every path
here is tested to equal them. A torch upgrade that changes the private CPU kernels touches this folder only.

- ``kernels``: the private ATen CPU flash-attention ops and their backward (public SDPA hides the log-sum-exp
  that merging several fused calls needs); the only place that names them.
- ``grid_flash``: joint softmax on the ``n x m`` grid as fused flash calls merged by log-sum-exps, one Function
  (``grid_flash_attention`` for the pooled axial Combiners; its two-part case ``causal_row_column_flash`` for
  ``axial`` / ``combiner_axial``).
- ``segment_flash``: ``combiner_fixed`` as one autograd Function (own segment + summary chunks).
- ``cluster_flash``: the causal k-means partition (``routing``, ``combiner_routing``) as fused flash calls.
- ``memory``: head groups sized by glibc's mmap threshold (a fresh 32 MiB block page-faults on every call).
"""
