"""The train step: compile_step and its options, the gradient phase of each mode, the step's buffers, ZeRO-3,
micro-batches, fp.verify and LoRA."""
