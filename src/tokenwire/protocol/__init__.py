"""tokenwire.protocol layer."""
