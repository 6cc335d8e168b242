"""What the services share, below them all: schemas, settings, hashing, wire formats, model bundles."""
