"""tokenwire.api layer."""
