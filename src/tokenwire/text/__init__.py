"""tokenwire.text layer."""
