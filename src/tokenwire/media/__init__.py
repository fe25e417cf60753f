"""tokenwire.media layer."""
