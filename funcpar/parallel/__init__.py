"""Parallelism's plumbing: the mesh, the collectives and point-to-point messages over its axes, the transport
under them, sharding leaves by their specs, and the ZeRO layout of a step's buffers."""
