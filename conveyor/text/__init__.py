"""Text: tokenizers (Hugging Face folders, GGUF vocabularies) and chat templates."""
