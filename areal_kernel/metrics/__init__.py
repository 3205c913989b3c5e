"""Built-in metric sinks: console, JSONL, TensorBoard."""
