"""A chat request's media: the parts found and inline data decoded (``items``), remote URLs
fetched (``fetch``, with the bounded gzip / deflate decoding of ``fetch_decode``) behind the
SSRF guard (``ssrf``). What comes out is a list of ``MediaItem`` ready for the encoders."""
