"""Compression schemes for pipeline boundaries (AQ-SGD and friends) and their per-sample caches.

The activation caches live in :mod:`aqsgd.schemes.cache`.
"""
