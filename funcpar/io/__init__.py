"""Reading and writing: train-state checkpoints, Hugging Face folders and the safetensors header, atomic folders."""
