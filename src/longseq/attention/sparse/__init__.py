"""Sparse patterns: each query attends to a fixed (or clustered) subset of keys, one softmax over it.

``base.SparseAttention`` is the family base: a variant defines ``pattern(L)`` (True = may attend) and a fast
``forward`` that never builds an ``L x L`` tensor; the dense reference ``attention_matrix``, key padding and
incremental decoding come from the pattern. ``kernels`` holds the computation several patterns share. One file
per variant, by the shape of its computation:

- block layouts + SDPA on 4-D tensors (blocks folded into the head axis): ``local`` (with ``longformer``),
  ``fixed``, ``bigbird``;
- two layouts of one grid (row-wise and column-wise logits joined in one softmax): ``axial``, ``strided``;
- a key table ``(L, K)`` gathered to ``(B*H, L, K, D)``, one query per SDPA head slot: ``random``;
- per-level broadcasts over power-of-two block pairs, no gather (``ops.log_levels``): ``logsparse``;
- online k-means clusters (``ops.clustering``): ``routing``.

Every row of every pattern keeps at least one key (self), so no softmax row is empty. Grid patterns lay positions
row-major on ``n x m`` with ``m = block_size`` (``ops.geometry.BlockGrid``), as their Combiner counterparts do.
"""
