"""The prompt cache kept across requests, and its files on disk."""
