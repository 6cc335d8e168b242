"""Core types shared by the front and the engine core: requests, messages between processes, errors."""
