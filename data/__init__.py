"""Grain next-token data: offline tokenizers, document sources (the built-in corpus, TFDS, local text),
and the inner (train) / outer (validation) streams with checkpointable state."""
