"""The studies: approximation, speed, activations, trade-off, showcase, peers, backward compatibility, sequence
parallelism, block sizes, decode speed, and their timing and isolation helpers. They may import
``experiments.train``."""
