"""tokenwire.engine layer."""
