"""Combiner (Ren et al. 2021): direct keys plus region summaries in one softmax, full attention support."""
