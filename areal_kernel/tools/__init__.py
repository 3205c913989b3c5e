"""Tool calls: parsers that find them in model output, and tools that answer them."""
