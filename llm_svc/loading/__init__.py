"""Loading a bundle: model and tokenizer, context length, media layout, prompt bounds."""
