"""Data: Megatron-LM indexed datasets (.bin/.idx), tokenizers, preparation, samples and blends."""
