"""Model sources: resolve a model name or path to a local HF directory."""
