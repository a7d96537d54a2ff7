"""memfit: train and serve transformer language models in the GPU memory you have."""

__version__ = "0.1.0"
