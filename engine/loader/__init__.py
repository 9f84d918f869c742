"""Model loaders: GGUF files and Hugging Face folders."""
