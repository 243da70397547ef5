"""router: an OpenAI-compatible gateway that knows which replicas anyone uses."""

__version__ = "0.1.0"
