"""tokenwire.parsers layer."""
