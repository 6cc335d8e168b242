"""Tiny random-weight checkpoints in publishers' exact layouts (``mmserve tiny-model --arch``).

``mmserve.tiny_model`` holds the mmserve bundle and Gemma 3 writers and the registry of every
``--arch``; the modules here add formats whose layout is not transformers' own."""
