"""Video: frame sampling, decoder backends (decord, torchcodec), chunked parallel decode."""
