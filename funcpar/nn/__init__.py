"""Neural-network pieces written per shard: tensor-parallel layers, element-wise kernels, causal attention, the
vocab-parallel head loss, what the decoders share, packed documents and activation recomputation."""
