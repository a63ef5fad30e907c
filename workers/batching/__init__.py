"""How a worker turns a stream into batches: the collector and its wait policies, length-aware grouping."""
