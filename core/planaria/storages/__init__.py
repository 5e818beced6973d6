"""Built-in checkpoint storage targets."""
