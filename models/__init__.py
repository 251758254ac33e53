"""Model definitions, installed as ``funcpar.models``: one module per architecture, written per shard."""
