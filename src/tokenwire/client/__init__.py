"""tokenwire.client layer."""
