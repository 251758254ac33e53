"""funcpar against its peers: ``python benchmarks/run.py`` (see run.py). Not installed with funcpar."""
