"""Shared attention kernels and rules (no registered classes): masks, padding, geometry, partition, joint
softmax, log levels, prefix sums, clustering, mixed precision, decoding."""
