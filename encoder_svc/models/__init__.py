"""Media encoders (vision tower + projector, Whisper encoder + projector) loaded from a bundle."""
