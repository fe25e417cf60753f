"""tokenwire.assets layer."""
