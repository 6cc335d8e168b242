"""HTTP routes of the gateway, one small module per concern."""
