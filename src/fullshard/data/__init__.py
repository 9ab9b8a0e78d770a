"""Training data: records from files, saved or Hub datasets, tokenized once per node, packed into
rows with document boundaries, batched per step and rank, resumable (also when streamed)."""
