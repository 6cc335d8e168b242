"""The C kernels' build and load (compiled on first use into the cache directory)."""
