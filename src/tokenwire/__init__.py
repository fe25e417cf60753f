"""tokenwire: a token-in/token-out LLM server for reinforcement-learning loops."""

__version__ = "0.1.0"
