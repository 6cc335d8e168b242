"""Media preprocessing: bytes -> model inputs. Decode errors are raised here, before batching."""
