"""What a checkpoint says about its model, read once from its files: the target's config (dense, DeepSeek-V3 /
Kimi fields, RoPE variants), its quantization, and an EAGLE-3 head's config. Below the layers, which are
built from these; nothing here imports torch modules of the model."""
