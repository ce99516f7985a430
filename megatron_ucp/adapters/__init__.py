"""Model adapters: map a model family's parameter names to canonical names and parallel patterns."""
