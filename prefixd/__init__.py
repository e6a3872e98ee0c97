"""prefixd: a persistent, crash-safe prefix KV-cache daemon for LLM inference hosts."""

__version__ = "0.1.0"
