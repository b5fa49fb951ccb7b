"""Sparse patterns: each query attends to a fixed (or clustered) subset of keys, one softmax over it."""
