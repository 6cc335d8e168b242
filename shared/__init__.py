"""mmserve's common package: schemas, settings, hashing, wire formats, model bundles."""
