"""Mirror-SD shared core: settings, protocol, speculative-decoding math, models, engine, storage, CLI."""

__version__ = "0.1.0"
