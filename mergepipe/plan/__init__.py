"""Planning: per-tensor parameters, the access set and its error bound, the output layout."""
