"""Indexing: model headers, family checks, blocks, and the statistics pass (block norms, hashes)."""
